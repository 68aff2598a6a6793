"""``launch submit --api trainjob``: the same launcher follows a Trainer v2.3.0 TrainJob on the scripted API server,
through the real kubernetes client: success, failure, queued (Kueue), timeout, SIGTERM, adoption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import launch_scenarios
import trainjob_scenarios as tj
from domino.launch import naming
from fake_kube import TRAINJOB_WEBHOOK, FakeKubeServer
from k8s_schemas import validate_trainer_object

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        yield srv


def launcher(server, lines, **overrides):
    return launch_scenarios.launcher(server, lines, api="trainjob", **overrides)


def test_success_follows_the_rank0_node_pod_and_reports_the_jobset_conditions(server):
    server.cluster.on_create = tj.succeed
    lines = []
    result = launcher(server, lines).run(tj.spec(), run_id="run-1", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded and result.phase == "Succeeded" and result.reason == "", result.reason
    assert result.name == "gpt-run-1" and result.exit_code == 0
    assert [line for line in lines if line.startswith(("step", "saved"))] == [
        "step 1 loss 10.8", "step 2 loss 9.1", "saved checkpoint iteration 2"]
    assert any(line.startswith("[gpt-run-1] Created: JobsStatus") for line in lines)
    assert "[gpt-run-1] Running: JobsStatus node Job: active 1, ready 1 (status.jobsStatus)" in lines
    assert "[gpt-run-1] Complete: AllJobsCompleted jobset completed successfully" in lines
    assert "created TrainJob domino/gpt-run-1 (run run-1)" in lines
    assert server.cluster.deleted == ["gpt-run-1"]  # on-success
    created = server.cluster.history[0][2]
    validate_trainer_object(created, "trainjobs")
    assert created["metadata"]["labels"][naming.RUN_ID_LABEL] == "run-1"
    verbs = server.cluster.verbs()
    assert {("trainer.kubeflow.org", "trainjobs", v) for v in ("create", "watch", "delete")} <= verbs
    assert not any(group == "kubeflow.org" for group, _, _ in verbs)


def test_failure_gives_the_jobset_reason_and_every_failed_node_log_and_keeps_the_job(server):
    server.cluster.on_create = tj.fail
    result = launcher(server, []).run(tj.spec(), run_id="run-2", scheduling_timeout_s=10, timeout_s=30)
    assert not result.succeeded and result.phase == "Failed"
    assert result.reason == ("FailedJobs: jobset failed due to one or more job failures (first failed job: "
                             "gpt-run-2-node-0)")
    assert result.exit_code == 1
    assert result.log_tail[-1] == "RuntimeError: [gloo] Connection closed by peer"
    (other,) = result.failed_pods
    assert other.startswith("gpt-run-2-node-0-1-") and result.failed_pods[other][-1].endswith("illegal memory "
                                                                                               "access was encountered")
    assert server.cluster.deleted == []  # on-success keeps a failed job for debugging


def test_timeout_deletes_the_trainjob_unless_cleanup_never(server):
    server.cluster.on_create = tj.run_forever
    start = time.monotonic()
    result = launcher(server, [], watch_timeout_s=30.0).run(tj.spec(), run_id="run-t1", scheduling_timeout_s=10,
                                                            timeout_s=1.0)
    assert result.reason.startswith("Timeout: ") and time.monotonic() - start < 10
    assert server.cluster.deleted == ["gpt-run-t1"]
    result = launcher(server, []).run(tj.spec(), run_id="run-t2", scheduling_timeout_s=10, timeout_s=1.0,
                                      cleanup="never")
    assert result.reason.startswith("Timeout: ") and server.cluster.deleted == ["gpt-run-t1"]


def test_the_controllers_deadline_is_a_failure_with_its_reason(server):
    server.cluster.on_create = tj.deadline_exceeded
    result = launcher(server, []).run(tj.spec(active_deadline_seconds=1), run_id="run-d", scheduling_timeout_s=10,
                                      timeout_s=30)
    assert result.phase == "Failed" and result.reason == "DeadlineExceeded: TrainJob exceeded its active deadline"


def test_pending_pods_count_as_active_but_the_job_is_not_running_until_ready(server):
    server.cluster.on_create = tj.stay_pending
    lines = []
    result = launcher(server, lines).run(tj.spec(), run_id="run-s", scheduling_timeout_s=1.5, timeout_s=60)
    assert result.reason.startswith("SchedulingTimeout: the job was still Created (not Running)"), result.reason
    assert "not scheduled: Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." in result.reason
    assert not any("] Running:" in line for line in lines)
    assert server.cluster.deleted == ["gpt-run-s"]


def test_pods_refused_at_admission_fail_at_the_scheduling_timeout_with_the_jobs_event(server):
    server.cluster.on_create = tj.pods_refused
    result = launcher(server, []).run(tj.spec(), run_id="run-p", scheduling_timeout_s=1.5, timeout_s=60)
    assert result.reason.startswith("SchedulingTimeout: the job was still Created (not Running)")
    assert ("no pods were created (is the TrainJob controller running" in result.reason
            and "event on gpt-run-p-node-0: FailedCreate: Error creating" in result.reason)
    assert server.cluster.deleted == ["gpt-run-p"]  # given up on


def test_a_missing_runtime_is_refused_by_the_webhook_before_anything_runs(server):
    server.cluster.runtimes = set()
    result = launcher(server, []).run(tj.spec(), run_id="run-w", scheduling_timeout_s=10, timeout_s=30)
    assert not result.succeeded
    assert result.reason.startswith(f'ApiError: 403 Forbidden: admission webhook "{TRAINJOB_WEBHOOK}" denied')
    assert "must be created before the TrainJob is created" in result.reason
    assert server.cluster.jobs == {} and ("trainer.kubeflow.org", "trainjobs", "delete") not in server.cluster.verbs()


def test_409_adopts_the_same_runs_trainjob_and_refuses_another_runs(server):
    job = launch_scenarios.plant(server, "trainjob", tj.spec(), "run-5", "run-5")
    threading.Thread(target=tj.succeed, args=(server.cluster, job), daemon=True).start()
    lines = []
    result = launcher(server, lines).run(tj.spec(), run_id="run-5", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded, result.reason
    assert any(line.startswith("adopting existing TrainJob domino/gpt-run-5") for line in lines)
    assert ("trainer.kubeflow.org", "trainjobs", "get") in server.cluster.verbs()
    launch_scenarios.plant(server, "trainjob", tj.spec(), "someone-else", "run-6")
    result = launcher(server, []).run(tj.spec(), run_id="run-6", scheduling_timeout_s=10, timeout_s=30,
                                      cleanup="always")
    assert result.reason.startswith("Conflict: a TrainJob named gpt-run-6") and "'someone-else'" in result.reason
    assert ("domino", "gpt-run-6") in server.cluster.jobs and server.cluster.deleted == ["gpt-run-5"]


def test_cli_submit_api_trainjob_sigterm_deletes_the_trainjob_and_exits_143(server, tmp_path):
    server.cluster.on_create = tj.run_forever
    env = {**os.environ, "KUBECONFIG": server.kubeconfig(str(tmp_path / "kubeconfig")), "PYTHONPATH": REPO}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    cmd = [sys.executable, "-m", "domino", "launch", "submit", "--api", "trainjob", "--name", "gpt", "--image",
           "img:1", "--nodes", "2", "--run-id", "cli-term", "--", "--preset", "tiny", "--train-iters", "2",
           "--mock-data"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server.cluster.wait_for(lambda: any(r[2] == "watch" for r in server.cluster.requests), timeout=60)
        # The launcher found the rank-0 node pod among the JobSet's pods and follows its log.
        server.cluster.wait_for(lambda: ("", "pods/log", "get") in server.cluster.verbs(), timeout=30)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "step 1 loss 10.8" in out  # the rank-0 node's log was followed
    assert "Interrupted" in err and server.cluster.deleted == ["gpt-cli-term"]
    assert server.cluster.history[0][2]["kind"] == "TrainJob"


def test_cli_submit_refuses_what_a_trainjob_cannot_carry_before_any_request(server, tmp_path):
    env = {**os.environ, "KUBECONFIG": server.kubeconfig(str(tmp_path / "kubeconfig")), "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "domino", "launch", "submit", "--api", "trainjob", "--name", "gpt", "--image",
           "img:1", "--backoff-limit", "2", "--", "--preset", "tiny", "--train-iters", "2", "--mock-data"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--api trainjob: --backoff-limit" in proc.stderr
    assert server.cluster.requests == []


def test_watch_disconnect_and_410_gone_relist_the_trainjob(server):
    server.cluster.on_create = tj.disconnect_then_410
    lines = []
    result = launcher(server, lines).run(tj.spec(), run_id="run-4", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded, result.reason
    assert any("410 Gone" in line for line in lines) and "finished while the watch was down" in lines
    assert ("trainer.kubeflow.org", "trainjobs", "list") in server.cluster.verbs()


def test_a_restarted_node_container_keeps_the_job_running_and_its_log_continues_once(server):
    server.cluster.on_create = tj.restart_then_succeed
    lines = []
    result = launcher(server, lines).run(tj.spec(), run_id="run-r", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded, result.reason
    assert [line for line in lines if line.startswith(("attempt", "resumed", "NCCL"))] == [
        "attempt 1 step 1", "NCCL error: connection reset", "resumed from iteration 1", "attempt 2 done"]
    assert any("container restarted (restart 1)" in line for line in lines)


def test_a_started_trainjob_whose_node_job_is_not_ready_stays_running():
    from domino.launch.job_api import job_api
    from domino.launch.kube_backend import JobTracker

    tracker = JobTracker("j", lambda _: None, job_api("trainjob"))
    status = lambda ready: {"spec": {}, "status": {"jobsStatus": [{"name": "node", "active": 1, "ready": ready}]}}  # noqa: E731
    tracker.update(status(0))
    assert (tracker.phase, tracker.started) == ("Created", False)  # pending pods count as active
    tracker.update(status(1))
    tracker.update(status(0))  # a container restarting
    assert (tracker.phase, tracker.started) == ("Running", True)
