"""``domino launch smoke``: one line per step. On the local backend its jobs really run (envcheck on two local
"nodes" all-reducing over gloo, a tiny pretrain that saves a checkpoint); on the cluster backend its admission
steps run against the local API server (fake_admission) and its jobs are scripted there as the operator runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import launch_scenarios as sc
from domino.launch.smoke import Smoke
from fake_kube import FakeKubeServer

REPO = Path(__file__).resolve().parents[2]


def test_the_local_smoke_runs_envcheck_on_two_nodes_a_training_run_that_saves_and_reaches_the_tracker(tmp_path,
                                                                                                       httpserver):
    httpserver.expect_request("/health", method="GET").respond_with_data("OK")  # an MLflow server's liveness
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([sys.executable, "-m", "domino", "launch", "smoke", "--name", "smoke", "--backend", "local",
                           "--workdir", str(tmp_path), "--nodes", "1", "--nproc-per-node", "1",
                           "--env", "OMP_NUM_THREADS=1", "--tracking-uri", httpserver.url_for("/")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "skip controllers", "skip dry-run pytorchjob", "skip dry-run trainjob", "skip pod-security",
        "ok   envcheck", "ok   train", "ok   egress", "ok   cleanup"], lines
    assert lines[6].endswith("(egress 200 OK)") and len(httpserver.log) == 1
    reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "smoke" / "envcheck").glob("envcheck-rank*.json"))]
    assert [(r["world_size"], r["all_reduce"] == r["expected"]) for r in reports] == [(2, True), (2, True)]
    assert lines[5].endswith(f"{tmp_path}/checkpoints/smoke-train-smoke/iter_0000004")
    assert (tmp_path / "checkpoints" / "smoke-train-smoke" / "iter_0000004").is_dir()


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        srv.cluster.on_create = sc.succeed  # the operator runs each job; its master logs a checkpoint save
        yield srv


def smoke(server, tracking_uri=None, **spec):
    lines = []
    steps = Smoke(sc.spec(name="smoke", namespace="domino", **spec), api_client=server.api_client(), timeout_s=60,
                  log=lines.append, tracking_uri=tracking_uri).run()
    return {step.name: step for step in steps}, lines


def test_the_cluster_smoke_passes_on_a_cluster_with_everything(server):
    steps, lines = smoke(server, tracking_uri="http://mlflow.mlflow:5000")
    assert [s.status for s in steps.values()] == ["ok"] * 8, lines
    assert list(steps) == ["controllers", "dry-run pytorchjob", "dry-run trainjob", "pod-security", "envcheck",
                           "train", "egress", "cleanup"]
    assert server.cluster.deleted == ["smoke-envcheck-smoke", "smoke-train-smoke", "smoke-egress-smoke"]
    (envcheck, train, egress) = [job for _, kind, job in server.cluster.history if kind == "ADDED"]
    probe = egress["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert probe[:2] == ["python", "-c"] and probe[-1] == "http://mlflow.mlflow:5000"
    assert len(server.cluster.dry_runs) == 3  # both APIs' jobs and a Worker pod, none stored
    assert envcheck["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1  # 2 nodes: Master + 1 Worker
    command = train["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["torchrun", "-m", "domino", "pretrain"] and "--mock-data" in command


def test_each_broken_piece_fails_its_own_step(server):
    server.cluster.deployments[("kubeflow", "training-operator")] = (1, [])  # no template flag
    server.cluster.runtimes.clear()  # the TrainJob's runtime is missing
    server.cluster.namespace_labels["domino"]["pod-security.kubernetes.io/enforce"] = "restricted"
    server.cluster.on_create = sc.fail
    steps, lines = smoke(server)
    assert {name: s.status for name, s in steps.items()} == {
        "controllers": "FAIL", "dry-run pytorchjob": "ok", "dry-run trainjob": "FAIL", "pod-security": "ok",
        "envcheck": "FAIL", "train": "FAIL", "egress": "skip", "cleanup": "ok"}, lines
    assert "runs without --pytorch-init-container-template-file" in steps["controllers"].detail
    assert 'denied the request' in steps["dry-run trainjob"].detail
    assert lines[0].startswith("FAIL controllers: Deployment kubeflow/training-operator: ")
