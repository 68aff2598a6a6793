"""``domino launch check`` against the local API server answering as the real one does (fake_kube ``_check_get``,
``_access_review``): with everything in place it passes, and each missing piece is one line naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import launch_scenarios as sc
from domino.launch.check import ClusterCheck, launcher_calls
from domino.launch.job_api import job_api
from fake_kube import FakeKubeServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        srv.cluster.kueue_frameworks.add("kubeflow.org/pytorchjob")  # Kueue configured as docs/cluster.md says
        yield srv


def check(server, api="pytorchjob", **spec):
    return ClusterCheck(job_api(api), server.api_client()).run(sc.spec(namespace="domino", **spec))


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_a_cluster_with_everything_passes(server, api):
    assert check(server, api, queue="team-a") == []
    assert ("authorization.k8s.io", "selfsubjectaccessreviews", "create") in server.cluster.verbs()



def test_a_kueue_older_than_v0_15_serving_only_v1beta1_passes(server):
    kueue = server.cluster.served.pop(("kueue.x-k8s.io", "v1beta2"))
    server.cluster.served[("kueue.x-k8s.io", "v1beta1")] = kueue
    assert check(server, queue="team-a") == []


MISSING = [  # (api, spec, how the cluster lacks it, the one line expected)
    ("pytorchjob", {}, lambda c: c.served.pop(("kubeflow.org", "v1")),
     "PyTorchJob: the API server does not serve pytorchjobs.kubeflow.org/v1 (404 Not Found: the server could not "
     "find the requested resource): is it installed?"),
    ("trainjob", {}, lambda c: c.runtimes.clear(),
     'TrainingRuntime domino/domino-torch-distributed: 404 Not Found: trainingruntimes.trainer.kubeflow.org '
     '"domino-torch-distributed" not found'),
    ("pytorchjob", {}, lambda c: c.pvcs.clear(),
     'PersistentVolumeClaim domino/domino-data: 404 Not Found: persistentvolumeclaims "domino-data" not found'),
    ("pytorchjob", {}, lambda c: c.pvcs.update({"domino-data": {"phase": "Pending", "accessModes": ["ReadWriteMany"]}}),
     "PersistentVolumeClaim domino/domino-data: not Bound (phase Pending)"),
    ("pytorchjob", {}, lambda c: c.pvcs.update({"domino-data": {"phase": "Bound", "accessModes": ["ReadWriteOnce"]}}),
     "PersistentVolumeClaim domino/domino-data: access modes ['ReadWriteOnce'] lack ReadWriteMany"),
    ("pytorchjob", {"queue": "team-b"}, lambda c: None,
     'LocalQueue domino/team-b: 404 Not Found: localqueues.kueue.x-k8s.io "team-b" not found'),
    ("trainjob", {"queue": "team-a"},
     lambda c: c.local_queues.update({"team-a": ("False", "ClusterQueueDoesNotExist",
                                                 "Can't submit new workloads to clusterQueue")}),
     "LocalQueue domino/team-a: not Active (ClusterQueueDoesNotExist: Can't submit new workloads to clusterQueue)"),
    ("pytorchjob", {"queue": "team-a"}, lambda c: c.served.pop(("kueue.x-k8s.io", "v1beta2")),
     "Kueue: the API server does not serve localqueues.kueue.x-k8s.io/v1beta2"),
    ("trainjob", {"queue": "team-b"},  # a Kueue before v0.15 serves v1beta1 only: the queue is looked up there
     lambda c: c.served.update({("kueue.x-k8s.io", "v1beta1"): c.served.pop(("kueue.x-k8s.io", "v1beta2"))}),
     'LocalQueue domino/team-b: 404 Not Found: localqueues.kueue.x-k8s.io "team-b" not found'),
    ("pytorchjob", {}, lambda c: c.denied.add(("kubeflow.org", "pytorchjobs", "create")),
     "RBAC: cannot create pytorchjobs.kubeflow.org in namespace domino (not allowed): bind the domino-launcher Role"),
    ("trainjob", {}, lambda c: c.denied.add(("", "pods/log", "get")),
     "RBAC: cannot get pods/log in namespace domino (not allowed)"),
    ("trainjob", {"queue": "team-a"}, lambda c: c.denied.add(("kueue.x-k8s.io", "workloads", "list")),
     "RBAC: cannot list workloads.kueue.x-k8s.io in namespace domino (not allowed)"),  # why a queued job waits
]


@pytest.mark.parametrize("api,spec,remove,expected", MISSING, ids=[m[3][:40] for m in MISSING])
def test_each_missing_piece_is_one_line(server, api, spec, remove, expected):
    remove(server.cluster)
    problems = check(server, api, **spec)
    assert len(problems) == 1, problems
    assert problems[0].startswith(expected), problems


def test_the_calls_checked_are_the_ones_the_launcher_role_grants():
    role = next(d for d in yaml.safe_load_all((REPO / "k8s/base/launcher-rbac.yaml").read_text()) if d["kind"] == "Role")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    for api in ("pytorchjob", "trainjob"):
        assert set(launcher_calls(job_api(api), queued=True)) <= granted


def test_the_cli_prints_each_problem_and_exits_1_then_0(server, tmp_path):
    kubeconfig = server.kubeconfig(str(tmp_path / "kubeconfig"))
    env = {**os.environ, "KUBECONFIG": kubeconfig, "PYTHONPATH": str(REPO)}
    env.pop("POD_NAMESPACE", None)
    argv = [sys.executable, "-m", "domino", "launch", "check", "--name", "gpt", "--namespace", "domino",
            "--gpus-per-node", "8", "--nproc-per-node", "8", "--nodes", "2", "--queue", "team-a"]
    server.cluster.pvcs.clear()
    server.cluster.denied.add(("kubeflow.org", "pytorchjobs", "delete"))
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [
        'PersistentVolumeClaim domino/domino-data: 404 Not Found: persistentvolumeclaims "domino-data" not found',
        "RBAC: cannot delete pytorchjobs.kubeflow.org in namespace domino (not allowed): bind the domino-launcher "
        "Role (k8s/base)"]
    server.cluster.pvcs["domino-data"] = {"phase": "Bound", "accessModes": ["ReadWriteMany"]}
    server.cluster.denied.clear()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ok: namespace domino has what a PyTorchJob"), done.stdout
