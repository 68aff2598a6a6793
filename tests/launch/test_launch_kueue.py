"""Kueue with both job APIs, against the local API server with Kueue v0.19.2's mutating webhook modelled
(fake_kube ``_kueue_default``, from ``pkg/controller/jobframework/base_webhook.go``): the launcher creates a
queued job unsuspended, Kueue suspends it where the integration is on, and where it is off (PyTorchJob
under the shipped configuration) the launcher fails at once with ``NotQueued`` instead of waiting forever."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import launch_scenarios as sc
import trainjob_scenarios as tj
from domino.launch.api import DEFAULT_QUEUE_TIMEOUT_S
from fake_kube import KUEUE_CONFIG, FakeKubeServer, kueue_frameworks

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {"pytorchjob": sc, "trainjob": tj}


def guide_frameworks() -> set:
    """The ``integrations.frameworks`` of the Kueue configuration snippet in docs/cluster.md."""
    text = (REPO / "docs" / "cluster.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "integrations:" in b]
    return kueue_frameworks(block)


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        yield srv


def test_the_shipped_kueue_config_queues_trainjobs_but_not_pytorchjobs():
    shipped = kueue_frameworks()
    assert "trainer.kubeflow.org/trainjob" in shipped and "kubeflow.org/pytorchjob" not in shipped
    assert "# - \"kubeflow.org/pytorchjob\"" in KUEUE_CONFIG.read_text()


def test_the_guides_snippet_keeps_every_default_integration_and_adds_pytorchjob():
    assert guide_frameworks() == kueue_frameworks() | {"kubeflow.org/pytorchjob"}


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_a_queued_job_is_created_unsuspended_and_kueue_suspends_then_admits_it(server, api):
    server.cluster.kueue_frameworks = guide_frameworks()
    scripts = SCRIPTS[api]
    server.cluster.on_create = scripts.queued_then_admitted
    lines = []
    result = sc.launcher(server, lines, api=api).run(scripts.spec(queue="team-a"), run_id="run-q",
                                                    scheduling_timeout_s=1.0, timeout_s=60)
    assert result.succeeded, result.reason
    (sent,) = server.cluster.sent  # the body as the launcher sent it
    assert sent["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "suspend" not in sent["spec"] and "suspend" not in sent["spec"].get("runPolicy", {})
    stored = server.cluster.history[0][2]  # after Kueue's webhook
    assert (stored["spec"]["runPolicy"]["suspend"] if api == "pytorchjob" else stored["spec"]["suspend"]) is True
    assert any("] Suspended: " in line for line in lines)


def test_a_queued_pytorchjob_under_the_shipped_kueue_config_fails_at_once_and_is_deleted(server):
    server.cluster.on_create = sc.succeed  # it would run, outside the queue's quota
    result = sc.launcher(server, []).run(sc.spec(queue="team-a"), run_id="run-nq", scheduling_timeout_s=10,
                                         timeout_s=60)
    assert not result.succeeded
    assert result.reason.startswith("NotQueued: Kueue did not suspend the PyTorchJob at creation")
    assert 'enable the "kubeflow.org/pytorchjob" integration' in result.reason
    assert server.cluster.deleted == ["gpt-run-nq"]  # given up on: deleted under on-success


def test_a_job_no_queue_manages_is_deleted_even_under_cleanup_never(server):
    server.cluster.on_create = sc.succeed  # kept, it would run outside the queue's quota
    result = sc.launcher(server, []).run(sc.spec(queue="team-a"), run_id="run-nq2", scheduling_timeout_s=10,
                                         timeout_s=60, cleanup="never")
    assert result.reason.startswith("NotQueued")
    assert server.cluster.deleted == ["gpt-run-nq2"]


def test_a_trainjob_without_kueue_installed_fails_not_queued(server):
    server.cluster.kueue_frameworks = set()
    server.cluster.on_create = tj.succeed
    result = sc.launcher(server, [], api="trainjob").run(tj.spec(queue="team-a"), run_id="run-nk",
                                                         scheduling_timeout_s=10, timeout_s=60)
    assert result.reason.startswith("NotQueued: Kueue did not suspend the TrainJob")
    assert '"trainer.kubeflow.org/trainjob"' in result.reason


def test_an_unqueued_job_is_never_touched_by_kueue(server):
    server.cluster.on_create = sc.succeed
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-u", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded, result.reason


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_queue_timeout_fails_and_deletes_a_job_never_admitted(server, api):
    server.cluster.kueue_frameworks = guide_frameworks()
    scripts = SCRIPTS[api]
    server.cluster.on_create = scripts.queued_forever
    result = sc.launcher(server, [], api=api).run(scripts.spec(queue="team-a"), run_id="run-qt",
                                                  scheduling_timeout_s=0.5, timeout_s=60, queue_timeout_s=1.5)
    assert result.reason.startswith("QueueTimeout: ") and result.phase == "Suspended"
    assert server.cluster.deleted == ["gpt-run-qt"]


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_a_job_preempted_after_the_queue_timeout_waits_for_readmission_and_finishes(server, api):
    """Kueue preempts a job that has run longer than the queue timeout: the launcher follows it through its
    suspension (the queue timeout counted from the moment it is suspended again, the scheduling timeout not
    at all) and back to Running, to Succeeded."""
    server.cluster.kueue_frameworks = guide_frameworks()
    scripts = SCRIPTS[api]
    server.cluster.on_create = scripts.preempted_then_readmitted
    lines = []
    result = sc.launcher(server, lines, api=api).run(scripts.spec(queue="team-a"), run_id="run-pre",
                                                    scheduling_timeout_s=0.5, timeout_s=60, queue_timeout_s=1.0)
    assert result.succeeded, result.reason
    running = next(i for i, line in enumerate(lines) if "] Running: " in line)
    assert any("] Suspended: " in line for line in lines[running:]), lines  # preempted while it ran


def test_the_default_queue_timeout_is_finite_everywhere():
    import inspect

    from components.pretrain.settings import PretrainSettings
    from domino.cli.launch import register
    from domino.launch.api import run_job
    import argparse

    assert 0 < DEFAULT_QUEUE_TIMEOUT_S < float("inf")
    assert inspect.signature(run_job).parameters["queue_timeout_s"].default == DEFAULT_QUEUE_TIMEOUT_S
    assert PretrainSettings.queue_timeout_s == DEFAULT_QUEUE_TIMEOUT_S
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["launch", "submit", "--name", "a", "--image", "b"])
    assert args.queue_timeout == DEFAULT_QUEUE_TIMEOUT_S
