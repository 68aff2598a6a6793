"""``domino launch smoke``: one line per step. On the local backend its jobs really run (envcheck on two local
"nodes" all-reducing over gloo, a tiny pretrain that saves a checkpoint); on the cluster backend its admission
steps run against the local API server (fake_admission) and its jobs are scripted there as the operator runs them."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import launch_scenarios as sc
from domino.launch.smoke import Smoke, pull_seconds
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
        "ok   envcheck", "ok   storage", "ok   train", "ok   metrics", "skip pull-time", "ok   egress",
        "ok   cleanup"], lines
    assert lines[9].endswith("(egress 200 OK)") and len(httpserver.log) == 1
    uid, host = os.getuid(), socket.gethostname()  # rank 0 wrote the probe, rank 1 (the other "node") read it
    assert lines[5].endswith(f"written on {host} as uid {uid}, read on {host} as uid {uid} (one host with "
                             "--backend local)")
    reply = json.loads((tmp_path / "smoke" / "envcheck" / "storage-reply.json").read_text())
    assert reply["wrote"] == {"host": host, "uid": uid} and reply["probe_owner"] == uid
    # scraped over real HTTP from rank 0's prometheus_client server while the run trained (log interval 1)
    assert re.search(r"/metrics answered over HTTP: domino_iteration [1-4]\.0$", lines[7]), lines[7]
    assert lines[8] == "skip pull-time: not applicable with --backend local (no image is pulled)"
    reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "smoke" / "envcheck").glob("envcheck-rank*.json"))]
    assert [(r["world_size"], r["all_reduce"] == r["expected"]) for r in reports] == [(2, True), (2, True)]
    assert lines[6].endswith(f"{tmp_path}/checkpoints/smoke-train-smoke/iter_0000004")
    assert (tmp_path / "checkpoints" / "smoke-train-smoke" / "iter_0000004").is_dir()


#: What rank 0 of `envcheck --storage` prints on a cluster whose claim is shared and pods run as UID 1000.
STORED = ("storage: written on smoke-envcheck-smoke-master-0 as uid 1000 (file owner 1000), read on "
          "smoke-envcheck-smoke-worker-0 as uid 1000 (answer's owner 1000)")
#: The kubelet's Pulled event (kubernetes pkg/kubelet/images/image_manager.go), as `kubectl describe pod` shows it.
PULLED = 'Successfully pulled image "registry.example/domino:1" in {} ({} including waiting). Image size: 9 bytes.'


def operator(stored=STORED, pulls=("4m12.5s", "850ms")):
    """The operator runs each job; envcheck's master logs the storage line, the train job's pods were pulled in
    ``pulls`` (the kubelet's events), every master logs a checkpoint save."""
    def on_create(c, job):
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        if "train" in name:
            for role, took in zip(("master", "worker"), pulls):
                c.add_event(ns, f"{name}-{role}-0", "Pulled", PULLED.format(took, took), "Normal")
        sc.succeed(c, job, ("step 2 loss 9.1", stored if "envcheck" in name else "saved checkpoint iteration 2"))
    return on_create


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        srv.cluster.on_create = operator()
        yield srv


def smoke(server, tracking_uri=None, **spec):
    lines = []
    steps = Smoke(sc.spec(name="smoke", namespace="domino", **spec), api_client=server.api_client(), timeout_s=60,
                  log=lines.append, tracking_uri=tracking_uri).run()
    return {step.name: step for step in steps}, lines


def test_the_cluster_smoke_passes_on_a_cluster_with_everything(server):
    steps, lines = smoke(server, tracking_uri="http://mlflow.mlflow:5000")
    assert [s.status for s in steps.values()] == ["ok"] * 7 + ["skip", "ok", "ok", "ok"], lines
    assert list(steps) == ["controllers", "dry-run pytorchjob", "dry-run trainjob", "pod-security", "envcheck",
                           "storage", "train", "metrics", "pull-time", "egress", "cleanup"]
    assert steps["pull-time"].detail == ("slowest pull 252.5 s (smoke-train-smoke-master-0) within the Worker's "
                                         "wait and the rendezvous timeout (--start-timeout 1200 s)")
    assert "written on smoke-envcheck-smoke-master-0 as uid 1000" in steps["storage"].detail
    assert server.cluster.deleted == ["smoke-envcheck-smoke", "smoke-train-smoke", "smoke-egress-smoke"]
    (envcheck, train, egress) = [job for _, kind, job in server.cluster.history if kind == "ADDED"]
    probe = egress["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert probe[:2] == ["python", "-c"] and probe[-1] == "http://mlflow.mlflow:5000"
    assert len(server.cluster.dry_runs) == 3  # both APIs' jobs and a Worker pod, none stored
    assert envcheck["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1  # 2 nodes: Master + 1 Worker
    command = train["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[5:9] == ["torchrun", "-m", "domino", "pretrain"] and "--mock-data" in command


def test_the_smoke_writes_no_secret_of_the_tracking_uri_and_its_probe_still_reaches_the_server(server, httpserver):
    httpserver.expect_request("/health", method="GET").respond_with_data("OK")
    steps, lines = smoke(server, tracking_uri="http://alice:s3cretPW@mlflow.mlflow:5000/?token=t0k3n")
    assert steps["egress"].detail.startswith("a training pod reached http://***@mlflow.mlflow:5000/?token=*** ("), lines
    egress = [job for _, kind, job in server.cluster.history if kind == "ADDED"][-1]
    probe = egress["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert not [text for text in [*lines, json.dumps(egress)] if "s3cretPW" in text or "t0k3n" in text]
    # The probe as the pod runs it, given the redacted URI of a real server: /health needs no credentials.
    given = httpserver.url_for("/").replace("http://", "http://***@") + "?token=***"
    done = subprocess.run([sys.executable, *probe[1:-1], given], capture_output=True, text=True, timeout=60)
    assert done.stdout == "egress 200 OK\n", done.stderr


def test_each_broken_piece_fails_its_own_step(server):
    server.cluster.deployments[("kubeflow", "training-operator")] = (1, [])  # no template flag
    server.cluster.runtimes.clear()  # the TrainJob's runtime is missing
    server.cluster.namespace_labels["domino"]["pod-security.kubernetes.io/enforce"] = "restricted"
    server.cluster.on_create = sc.fail
    steps, lines = smoke(server)
    assert {name: s.status for name, s in steps.items()} == {
        "controllers": "FAIL", "dry-run pytorchjob": "ok", "dry-run trainjob": "FAIL", "pod-security": "ok",
        "envcheck": "FAIL", "storage": "skip", "train": "FAIL", "metrics": "skip", "pull-time": "ok", "egress": "skip",
        "cleanup": "ok"}, lines
    assert "runs without --pytorch-init-container-template-file" in steps["controllers"].detail
    assert 'denied the request' in steps["dry-run trainjob"].detail
    assert lines[0].startswith("FAIL controllers: Deployment kubeflow/training-operator: ")


def test_a_root_squashed_claim_one_node_and_a_pull_over_the_wait_fail_their_steps(server):
    server.cluster.on_create = operator(
        stored=("storage: written on node-a as uid 1000 (file owner 65534), read on node-a as uid 0 (answer's "
                "owner 0)"), pulls=("21m3s", "1m"))
    steps, lines = smoke(server)
    assert {name: s.status for name, s in steps.items() if s.status == "FAIL"} == {
        "storage": "FAIL", "pull-time": "FAIL"}, lines
    assert steps["storage"].detail == (
        "the reader ran as uid 0, not the pods' runAsUser 1000; the probe is owned by uid 65534, not 1000 (a "
        "root-squashing export? docs/cluster.md, Storage); both ranks ran on node-a: not a cross-node check")
    assert steps["pull-time"].detail.startswith("slowest pull 1263.0 s (smoke-train-smoke-master-0) is over ")
    assert steps["pull-time"].detail.endswith("(--start-timeout 1200 s): raise --start-timeout or pre-pull "
                                              "(k8s/prepull)")


@pytest.mark.parametrize("message, seconds", [
    (PULLED.format("1h2m3.5s", "1h2m4s"), 3723.5), (PULLED.format("850ms", "1s"), 0.85),
    ('Container image "registry.example/domino:1" already present on machine', None)])
def test_the_pull_time_is_read_from_the_kubelets_message(message, seconds):
    assert pull_seconds(message) == seconds
