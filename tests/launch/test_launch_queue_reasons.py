"""Queue waits that speak: while Kueue holds a job suspended the launcher reads its Workload (found by the
``kueue.x-k8s.io/job-uid`` label and the owner reference, as Kueue v0.19.2's reconciler makes it: fake_admission
``set_workload``) and prints Kueue's own reason each time it changes, and in the final ``QueueTimeout``."""

from __future__ import annotations

import time

import pytest

import launch_scenarios as sc
import trainjob_scenarios as tj
from domino.launch.kueue_workload import workload_reason
from fake_kube import FakeKubeServer

SCRIPTS = {"pytorchjob": sc, "trainjob": tj}
NO_QUOTA = ("couldn't assign flavors to pod set node: insufficient unused quota for nvidia.com/gpu in flavor "
            "default-flavor, 8 more needed")
NO_FLAVOR = "couldn't assign flavors to pod set node: resource nvidia.com/gpu unavailable in ClusterQueue"


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        srv.cluster.kueue_frameworks.add("kubeflow.org/pytorchjob")  # Kueue configured as docs/cluster.md says
        yield srv


def never_admitted(api, visible=True):
    """Kueue suspends the job, creates its Workload without quota, then (a ClusterQueue edit) changes why."""
    def script(c, job):
        SCRIPTS[api].queued_forever(c, job)
        ns = job["metadata"]["namespace"]
        name = c.set_workload(ns, job, [("QuotaReserved", "False", "Pending", NO_QUOTA),
                                        ("Admitted", "False", "NoReservation", "The workload has no reservation")])
        if visible:
            c.pending[(ns, "team-a")] = ["someone-else", name]
        time.sleep(0.6)
        c.set_workload(ns, job, [("QuotaReserved", "False", "Pending", NO_FLAVOR)])
    return script


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_kueues_reasons_are_printed_when_they_change_and_end_the_queue_timeout(server, api):
    server.cluster.on_create = never_admitted(api)
    lines = []
    result = sc.launcher(server, lines, api=api, queue_poll_s=0.1).run(
        SCRIPTS[api].spec(queue="team-a"), run_id="run-w", scheduling_timeout_s=0.5, timeout_s=60, queue_timeout_s=2.0)
    kind = "pytorchjob" if api == "pytorchjob" else "trainjob"
    waits = [line for line in lines if "waiting in queue team-a" in line]
    assert len(waits) == 2, lines  # once per change, not once per read
    assert waits[0].startswith(f"[gpt-run-w] waiting in queue team-a: Workload {kind}-gpt-run-w-")
    assert waits[0].endswith(f"QuotaReserved False (Pending): {NO_QUOTA}; Admitted False (NoReservation): The "
                             "workload has no reservation; 1 workload(s) ahead of it in LocalQueue team-a")
    assert waits[1].endswith(f"QuotaReserved False (Pending): {NO_FLAVOR}; 1 workload(s) ahead of it in LocalQueue "
                             "team-a")
    assert result.reason.startswith("QueueTimeout: the job waited in queue (suspended, not admitted) for 2 s; "
                                    f"Kueue: Workload {kind}-gpt-run-w-"), result.reason
    assert result.reason.endswith(waits[1].split("waiting in queue team-a: ")[1])
    assert ("kueue.x-k8s.io", "workloads", "list") in server.cluster.verbs()


def test_without_the_visibility_api_the_conditions_alone_are_reported(server):
    server.cluster.visibility = False
    server.cluster.on_create = never_admitted("trainjob", visible=False)
    lines = []
    result = sc.launcher(server, lines, api="trainjob", queue_poll_s=0.1).run(
        tj.spec(queue="team-a"), run_id="run-v", scheduling_timeout_s=0.5, timeout_s=60, queue_timeout_s=1.0)
    assert result.reason.startswith("QueueTimeout:") and "QuotaReserved False (Pending)" in result.reason
    assert not any("cannot read" in line for line in lines), lines  # a missing API is not an error


def test_the_reason_names_each_condition_and_evicted_only_while_true():
    assert workload_reason({"status": {}}) == "no conditions yet (Kueue has not considered it)"
    evicted = {"status": {"conditions": [{"type": "Evicted", "status": "False", "reason": "x"},
                                         {"type": "Admitted", "status": "True", "reason": "Admitted"}]}}
    assert workload_reason(evicted) == "Admitted True (Admitted)"
