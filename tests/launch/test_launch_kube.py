"""The PyTorchJob launcher against a scripted local API server, through the real kubernetes client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import launch_scenarios as sc
from domino.launch import naming
from fake_kube import FakeKubeServer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        yield srv


def test_success_streams_master_log_reports_conditions_and_cleans_up(server):
    server.cluster.on_create = sc.succeed
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-1", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded and result.phase == "Succeeded" and result.reason == ""
    assert result.name == "gpt-run-1" and result.exit_code == 0
    # Every master line arrives exactly once, in order.
    assert [line for line in lines if line.startswith(("step", "saved"))] == [
        "step 1 loss 10.8", "step 2 loss 9.1", "saved checkpoint iteration 2"]
    for cond in ("Created", "Running", "Succeeded"):
        assert any(line.startswith(f"[gpt-run-1] {cond}:") for line in lines), cond
    assert server.cluster.deleted == ["gpt-run-1"]  # on-success
    created = server.cluster.history[0][2]
    assert created["metadata"]["labels"][naming.RUN_ID_LABEL] == "run-1"


def test_failure_gives_reason_exit_code_and_last_log_lines_and_keeps_job(server):
    server.cluster.on_create = sc.fail
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-2", scheduling_timeout_s=10, timeout_s=30)
    assert not result.succeeded and result.phase == "Failed"
    assert result.reason.startswith("PyTorchJobFailed: ") and "1 Master replica(s) failed" in result.reason
    assert result.exit_code == 1
    assert result.log_tail[-1] == "RuntimeError: CUDA out of memory"
    text = result.describe()
    assert "PyTorchJobFailed" in text and "RuntimeError: CUDA out of memory" in text
    assert server.cluster.deleted == []  # on-success keeps a failed job for debugging


def test_restart_is_reported_and_logs_continue_without_duplicates(server):
    server.cluster.on_create = sc.restart_then_succeed
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-r", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded
    assert any("Restarting" in line for line in lines)
    shown = [line for line in lines if line.startswith(("attempt", "resumed", "NCCL"))]
    assert shown == ["attempt 1 step 1", "NCCL error: connection reset", "resumed from iteration 1",
                     "attempt 2 done"]


def test_scheduling_timeout_explains_with_pod_conditions_and_events(server):
    server.cluster.on_create = sc.stay_pending
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-3", scheduling_timeout_s=2.0, timeout_s=30,
                                         cleanup="always")
    assert not result.succeeded and result.reason.startswith("SchedulingTimeout: ")
    assert "Insufficient nvidia.com/gpu" in result.reason
    assert "ImagePullBackOff" in result.reason and "Failed to pull image" in result.reason
    assert "Successfully assigned" not in result.reason  # Normal events are noise
    assert server.cluster.deleted == ["gpt-run-3"]


def test_watch_disconnect_and_410_gone_relist(server):
    server.cluster.on_create = sc.disconnect_then_410
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-4", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded, result.reason
    assert any("410 Gone" in line for line in lines)
    assert ("kubeflow.org", "pytorchjobs", "list") in server.cluster.verbs()
    assert sum(1 for r in server.cluster.requests if r[2] == "watch") >= 3
    assert "finished while the watch was down" in lines


def test_409_adopts_the_same_runs_job(server):
    job = sc.plant(server, "pytorchjob", sc.spec(), "run-5", "run-5")
    threading.Thread(target=sc.succeed, args=(server.cluster, job), daemon=True).start()
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-5", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded
    assert any(line.startswith("adopting existing PyTorchJob domino/gpt-run-5") for line in lines)
    assert ("kubeflow.org", "pytorchjobs", "get") in server.cluster.verbs()


OLD_OWNER = {"apiVersion": "v1", "kind": "Pod", "name": "pretrain-attempt-1", "uid": "uid-attempt-1",
             "controller": False, "blockOwnerDeletion": False}
WORKFLOW = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "run", "uid": "uid-workflow"}


def _owner_uids(job):
    return [ref["uid"] for ref in job["metadata"].get("ownerReferences") or []]


def _plant_owned(server, run_id):
    body = sc.job_api("pytorchjob").render(sc.spec(), run_id, OLD_OWNER)
    body["metadata"]["ownerReferences"].append(WORKFLOW)
    return server.cluster.add_job(body)


def test_adoption_makes_this_pod_the_owner_in_place_of_the_first_attempts(server, monkeypatch):
    """Else the garbage collector deletes the job when the first attempt's pod is collected. A status update
    between the launcher's read and its patch makes the patch stale: a 409, read again, patched again."""
    monkeypatch.setenv("POD_NAME", "pretrain-attempt-2")
    monkeypatch.setenv("POD_UID", "uid-attempt-2")
    monkeypatch.setenv("POD_NAMESPACE", "domino")
    job = _plant_owned(server, "run-7")
    patches = []

    def operator_writes_first(c, ns, name):
        patches.append(name)
        if len(patches) == 1:
            c.set_condition(ns, name, "Created", "PyTorchJobCreated", "created")

    def succeed_once_adopted(c, job):
        # The job's life starts after the adoption, so the scripted write above is the only one between the
        # launcher's reads and its patches (the life's own status writes would make further patches stale).
        key = (job["metadata"]["namespace"], job["metadata"]["name"])
        with c.cond:
            assert c.cond.wait_for(lambda: "uid-attempt-2" in _owner_uids(c.jobs[key]), timeout=30)
        sc.succeed(c, job)

    server.cluster.before_patch = operator_writes_first
    threading.Thread(target=succeed_once_adopted, args=(server.cluster, job), daemon=True).start()
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-7", scheduling_timeout_s=10, timeout_s=30,
                                            cleanup="never")
    assert result.succeeded, result.reason
    owners = server.cluster.jobs[("domino", "gpt-run-7")]["metadata"]["ownerReferences"]
    assert owners == [WORKFLOW, {**OLD_OWNER, "name": "pretrain-attempt-2", "uid": "uid-attempt-2"}]
    assert len(patches) == 2  # the first was refused as stale, the second applied
    assert "PyTorchJob domino/gpt-run-7 is now owned by this pod, pretrain-attempt-2" in lines
    assert server.cluster.jobs[("domino", "gpt-run-7")]["status"]["conditions"]  # status untouched by the patch


def test_adoption_without_patch_rights_says_so_and_follows_the_job(server, monkeypatch):
    monkeypatch.setenv("POD_NAME", "pretrain-attempt-2")
    monkeypatch.setenv("POD_UID", "uid-attempt-2")
    job = _plant_owned(server, "run-8")
    server.cluster.forbid_patch = True
    threading.Thread(target=sc.succeed, args=(server.cluster, job), daemon=True).start()
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-8", scheduling_timeout_s=10, timeout_s=30)
    assert result.succeeded
    assert any(line.startswith("warning: could not make pod pretrain-attempt-2 the owner of PyTorchJob "
                               "domino/gpt-run-8 (403 Forbidden)") and "'patch'" in line for line in lines)


def test_the_fake_api_server_patches_custom_resources_as_kubernetes_does(server):
    """Merge patch only (415 for strategic merge), lists replaced whole, null deletes, stale versions 409."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    job = _plant_owned(server, "run-9")
    custom = client.CustomObjectsApi(server.api_client())
    args = ("kubeflow.org", "v1", "domino", "pytorchjobs", job["metadata"]["name"])
    patched = custom.patch_namespaced_custom_object(*args, {"metadata": {"ownerReferences": [WORKFLOW],
                                                                         "annotations": {"a": "1"}}})
    assert patched["metadata"]["ownerReferences"] == [WORKFLOW] and patched["metadata"]["annotations"]["a"] == "1"
    patched = custom.patch_namespaced_custom_object(*args, {"metadata": {"annotations": {"a": None}}})
    assert "a" not in patched["metadata"]["annotations"]
    with pytest.raises(ApiException) as stale:
        custom.patch_namespaced_custom_object(*args, {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"],
                                                                   "labels": {"x": "y"}}})
    assert stale.value.status == 409
    api = server.api_client()
    with pytest.raises(ApiException) as strategic:
        api.call_api(f"/apis/kubeflow.org/v1/namespaces/domino/pytorchjobs/{args[-1]}", "PATCH",
                     header_params={"Content-Type": "application/strategic-merge-patch+json"},
                     body={"metadata": {"labels": {"x": "y"}}}, response_type="object")
    assert strategic.value.status == 415


def test_409_refuses_another_runs_job_and_leaves_it_alone(server):
    sc.plant(server, "pytorchjob", sc.spec(), "someone-else", "run-6")
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-6", scheduling_timeout_s=10, timeout_s=30,
                                         cleanup="always")
    assert not result.succeeded and result.reason.startswith("Conflict: ")
    assert "'someone-else'" in result.reason
    assert server.cluster.deleted == [] and ("default", "gpt-run-6") not in server.cluster.jobs
    assert ("domino", "gpt-run-6") in server.cluster.jobs


def test_overall_timeout_is_a_wall_clock_deadline(server):
    server.cluster.on_create = sc.run_forever
    start = time.monotonic()
    result = sc.launcher(server, [], watch_timeout_s=30.0).run(
        sc.spec(), run_id="run-7", scheduling_timeout_s=10, timeout_s=1.0, cleanup="always")
    assert result.reason.startswith("Timeout: ") and not result.succeeded
    assert time.monotonic() - start < 10  # not the 30 s watch window
    assert server.cluster.deleted == ["gpt-run-7"]


def test_sigterm_deletes_the_job(server):
    def running_then_cancelled(c, job):  # the pipeline is cancelled while the job runs
        sc.run_forever(c, job)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    server.cluster.on_create = running_then_cancelled
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-8", scheduling_timeout_s=10, timeout_s=30)
    assert result.reason.startswith("Interrupted: ") and not result.succeeded
    assert server.cluster.deleted == ["gpt-run-8"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored


def test_owner_reference_to_launching_pod(server, monkeypatch):
    monkeypatch.setenv("POD_NAME", "pipeline-step-abc")
    monkeypatch.setenv("POD_UID", "1234-uid")
    server.cluster.on_create = sc.succeed
    sc.launcher(server, []).run(sc.spec(), run_id="run-9", scheduling_timeout_s=10, timeout_s=30)
    refs = server.cluster.history[0][2]["metadata"]["ownerReferences"]
    assert refs == [{"apiVersion": "v1", "kind": "Pod", "name": "pipeline-step-abc", "uid": "1234-uid",
                     "controller": False, "blockOwnerDeletion": False}]


def _cli(server, tmp_path, extra):
    env = {**os.environ, "KUBECONFIG": server.kubeconfig(str(tmp_path / "kubeconfig")), "PYTHONPATH": REPO}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    cmd = [sys.executable, "-m", "domino", "launch", "submit", "--name", "gpt", "--image", "img:1", "--nodes", "2",
           "--scheduling-timeout", "10", "--timeout", "60", *extra, "--", "--preset", "tiny", "--train-iters", "2",
           "--mock-data"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_cli_submit_success_and_failure_exit_codes(server, tmp_path):
    server.cluster.on_create = sc.succeed
    ok = _cli(server, tmp_path, ["--run-id", "cli-ok"])
    assert ok.returncode == 0, ok.stderr
    assert "step 2 loss 9.1" in ok.stdout and "job gpt-cli-ok: Succeeded" in ok.stdout
    server.cluster.on_create = sc.fail
    bad = _cli(server, tmp_path, ["--run-id", "cli-bad", "--cleanup", "always"])
    assert bad.returncode == 1
    assert "PyTorchJobFailed" in bad.stderr and "RuntimeError: CUDA out of memory" in bad.stderr
    assert server.cluster.deleted == ["gpt-cli-ok", "gpt-cli-bad"]


def test_api_errors_end_with_a_clear_result_not_a_traceback(server):
    server.cluster.forbid_create = True
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-f", scheduling_timeout_s=10, timeout_s=30)
    assert not result.succeeded
    assert result.reason.startswith("ApiError: 403 Forbidden: pytorchjobs.kubeflow.org is forbidden")
    assert ("kubeflow.org", "pytorchjobs", "delete") not in server.cluster.verbs()


def test_unreachable_api_is_reported():
    from kubernetes import client

    config = client.Configuration()
    config.host = "http://127.0.0.1:9"  # discard port: connection refused
    config.retries = 0
    launcher = sc.JobLauncher(api_client=client.ApiClient(config), log=lambda _: None, request_timeout_s=2)
    result = launcher.run(sc.spec(), run_id="run-u", scheduling_timeout_s=10, timeout_s=30)
    assert result.reason.startswith("ApiUnreachable: ") and not result.succeeded


def test_cli_submit_sigterm_deletes_job_and_exits_143(server, tmp_path):
    server.cluster.on_create = sc.run_forever
    env = {**os.environ, "KUBECONFIG": server.kubeconfig(str(tmp_path / "kubeconfig")), "PYTHONPATH": REPO}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    cmd = [sys.executable, "-m", "domino", "launch", "submit", "--name", "gpt", "--image", "img:1",
           "--run-id", "cli-term", "--", "--preset", "tiny", "--train-iters", "2", "--mock-data"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server.cluster.wait_for(lambda: any(r[2] == "watch" for r in server.cluster.requests), timeout=60)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Interrupted" in err and server.cluster.deleted == ["gpt-cli-term"]


def test_cli_submit_rejects_bad_pretrain_args_before_creating_anything(server, tmp_path):
    bad = _cli(server, tmp_path, ["--run-id", "cli-typo", "--", "--tensor-model-parallel-sise", "2"])
    assert bad.returncode == 2
    assert "domino pretrain arguments: unrecognized arguments: --tensor-model-parallel-sise" in bad.stderr
    assert server.cluster.requests == []


def test_replicas_refused_by_pod_security_fail_within_the_scheduling_timeout(server):
    """The job shows Running (the Master runs) but the Workers are never created: the launcher notices
    at the scheduling deadline, fails with the FailedCreatePod reason, and deletes the job."""
    server.cluster.on_create = sc.workers_refused
    start = time.monotonic()
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-ps", scheduling_timeout_s=1.5, timeout_s=60)
    assert time.monotonic() - start < 20
    assert not result.succeeded and result.reason.startswith("IncompleteReplicas: only 1 of 2 pods were running")
    assert "FailedCreatePod" in result.reason and 'violates PodSecurity "restricted:latest"' in result.reason
    assert server.cluster.deleted == ["gpt-run-ps"]  # given up on: deleted even under on-success


def test_failure_reports_the_logs_of_every_failed_pod(server):
    server.cluster.on_create = sc.worker_fails
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-wf", scheduling_timeout_s=10, timeout_s=30)
    assert not result.succeeded and "1 Worker replica(s) failed" in result.reason
    assert result.failed_pods["gpt-run-wf-worker-0"][-1].endswith("an illegal memory access was encountered")
    assert "gpt-run-wf-master-0" not in result.failed_pods  # the Master's log is the main tail
    assert result.log_tail[-1] == "RuntimeError: [gloo] Connection closed by peer"
    assert "last 2 log lines of failed pod gpt-run-wf-worker-0:" in result.describe()
    assert server.cluster.deleted == []  # a Failed job is kept by on-success


def test_timeout_deletes_the_job_unless_cleanup_never(server):
    server.cluster.on_create = sc.run_forever
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-t1", scheduling_timeout_s=10, timeout_s=1.0)
    assert result.reason.startswith("Timeout: ") and server.cluster.deleted == ["gpt-run-t1"]
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-t2", scheduling_timeout_s=10, timeout_s=1.0,
                                         cleanup="never")
    assert result.reason.startswith("Timeout: ") and server.cluster.deleted == ["gpt-run-t1"]
