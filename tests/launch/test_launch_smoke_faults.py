"""``domino launch smoke --faults`` against the local API server: a Worker deleted, the Master deleted mid-save,
the Workload deactivated and reactivated; the operator's and Kueue's reactions are fake_faults' models."""

from __future__ import annotations

import pytest

import launch_scenarios as sc
from domino.launch.smoke import Smoke
from fake_kube import FakeKubeServer
from test_launch_smoke import operator

RESUMED = ("resumed from /data/checkpoints/smoke-fault-master-smoke/iter_0000003 at iteration 3 (96 samples "
           "consumed)")


def _recreated(c, ns, pod):
    """Waits until ``pod`` was deleted through the API and the operator's new one runs."""
    c.wait_for(lambda: pod in c.pod_deletes and (c.pods.get((ns, pod)) or {}).get("status", {}).get("phase")
               == "Running", timeout=20)


def cluster(c, job):
    """The operator and Kueue: each job admitted (with a queue), the fault jobs broken by the smoke recover."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    if job["spec"].get("runPolicy", {}).get("suspend"):  # Kueue's webhook suspended it: admit it
        c.set_workload(ns, job, [("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "Admitted", "")])
        c.set_suspend(ns, name, False)
    if "fault-worker" in name:
        sc.start_running(c, job)
        _recreated(c, ns, f"{name}-worker-0")
        sc.succeed(c, job)
    elif "fault-master" in name:
        master = sc.start_running(c, job, ("iteration 3", "saved checkpoint /data/checkpoints/x/iter_0000003"))
        _recreated(c, ns, master)
        sc.succeed(c, job, (RESUMED, "saved checkpoint iteration 12"))
    elif "fault-queue" in name:
        sc.start_running(c, job)
        c.wait_for(lambda: any(cond["reason"] == "Reactivated" for w in c.workloads.values()
                               for cond in w["status"]["conditions"]), timeout=20)
        sc.succeed(c, job)
    else:
        operator()(c, job)


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        srv.cluster.on_create = cluster
        yield srv


def smoke(server, **spec):
    lines = []
    steps = Smoke(sc.spec(name="smoke", namespace="domino", **spec), api_client=server.api_client(), timeout_s=30,
                  log=lines.append, faults=True).run()
    return {step.name: step for step in steps}, lines


def test_the_faults_are_injected_while_the_jobs_train_and_each_recovery_is_seen(server):
    server.cluster.kueue_frameworks.add("kubeflow.org/pytorchjob")
    steps, lines = smoke(server, queue="team-a")
    faults = [s for s in steps.values() if s.name.startswith("fault")]
    assert [(s.name, s.status) for s in faults] == [
        ("fault: delete worker", "ok"), ("fault: delete master mid-save", "ok"),
        ("fault: deactivate workload", "ok")], lines
    assert all(s.status != "FAIL" for s in steps.values()), lines
    assert faults[0].detail == ("smoke-fault-worker-smoke-worker-0 deleted while it ran; the controller recreated "
                                "it (smoke-fault-worker-smoke-worker-0); the job succeeded")
    assert faults[1].detail.endswith("after a save, with the next under way; the run resumed from /data/checkpoints/"
                                     "smoke-fault-master-smoke/iter_0000003 at iteration 3 (96 samples consumed) "
                                     "and succeeded")
    assert faults[2].detail.startswith("Workload pytorchjob-smoke-fault-queue-smoke-")
    (workload,) = [w for w in server.cluster.workloads.values() if "fault-queue" in w["metadata"]["name"]]
    assert workload["spec"]["active"] is True
    reasons = {c["type"]: c["reason"] for c in workload["status"]["conditions"]}
    assert reasons["Requeued"] == "Reactivated" and reasons["Admitted"] == "Admitted"
    assert server.cluster.pod_deletes == ["smoke-fault-worker-smoke-worker-0", "smoke-fault-master-smoke-master-0"]
    assert {"smoke-fault-worker-smoke", "smoke-fault-master-smoke", "smoke-fault-queue-smoke"} <= set(
        server.cluster.deleted)  # --cleanup always


def refused(c, job):
    """RBAC refuses the smoke's pod deletes: each fault job runs until its delete was tried, then succeeds."""
    name = job["metadata"]["name"]
    if "fault" not in name:
        return operator()(c, job)
    sc.start_running(c, job, ("saved checkpoint /data/checkpoints/x/iter_0000001",))
    tried = 1 if "fault-worker" in name else 2
    c.wait_for(lambda: c.requests.count(("", "pods", "delete")) >= tried, timeout=20)
    sc.succeed(c, job)


def test_without_the_smoke_role_the_fault_fails_its_step_naming_k8s_smoke(server):
    server.cluster.denied = {("", "pods", "delete")}
    server.cluster.on_create = refused
    steps, lines = smoke(server)
    assert [s.status for s in steps.values() if s.name.startswith("fault")] == ["FAIL", "FAIL", "skip"], lines
    assert steps["fault: delete worker"].detail == (
        "deleting pod smoke-fault-worker-smoke-worker-0: 403 Forbidden (the fault steps need k8s/smoke's Role: "
        "kubectl apply --server-side -k k8s/smoke)")
    assert server.cluster.pod_deletes == []
    assert steps["fault: deactivate workload"].status == "skip"  # no --queue
