"""Progress in the TrainJob (domino/tracking/trainer_status.py): rank 0 of a real `domino pretrain` posts
``status.trainerStatus`` to a local HTTPS server that answers like Kubeflow Trainer v2.3.0's status server
(tests/tracking/trainer_status_server.py cites what it is modelled on), with the variables, files and token the
Trainer's ``TrainJobStatus`` plugin gives a trainer container."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from domino.tracking.trainer_status import (CA_CERT_ENV, INTERVAL_S, TOKEN_ENV, URL_ENV, Endpoint, TrainerStatusPoster,
                                            post, trainer_status)
from train_helpers import child_env, pretrain_command, read_metrics
from trainer_status_server import StatusServer, TokenIssuer, make_tls, serve, silent_listener

NS, JOB = "team-a", "gpt-tiny"
PATH = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs/{JOB}/status"
BASE = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--num-workers", "0", "--seed", "7",
        "--eval-iters", "0", "--eval-interval", "0"]


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def trainer(tls, tmp_path):
    """The status server, and the endpoint and token file a trainer container of TrainJob ``JOB`` gets."""
    state = StatusServer(TokenIssuer(), trainjobs={(NS, JOB): None})
    httpd, port = serve(state, tls[1], tls[2])
    token = tmp_path / "token"
    token.write_text(state.issuer.token(NS, JOB))
    yield state, Endpoint(f"https://localhost:{port}{PATH}", str(tls[0]), str(token))
    httpd.shutdown()
    httpd.server_close()


def rotate(path: str, token: str) -> None:
    """Replaces the token file in one rename, as the kubelet's atomic writer swaps a projected volume's files."""
    Path(path + ".new").write_text(token)
    os.replace(path + ".new", path)


def record(iteration: int, **extra) -> dict:
    return {"iteration": iteration, "lm_loss": 5.25, "tokens_per_s": 1234.5, "eta_s": 99.6, **extra}


def test_a_record_becomes_a_status_the_trainer_accepts(trainer):
    state, endpoint = trainer
    observed = datetime(2026, 11, 3, 9, 30, 5, 123456, tzinfo=timezone.utc)
    status = trainer_status(record(3, goodput=0.81234567), 8, observed)
    assert status == {"progressPercentage": 37, "estimatedRemainingSeconds": 100, "lastUpdatedTime":
                      "2026-11-03T09:30:05Z", "metrics": [{"name": "iteration", "value": "3/8"}, {"name": "loss",
                      "value": "5.25"}, {"name": "tokens_per_s", "value": "1234.5"}, {"name": "goodput", "value": "0.812346"}]}
    post(endpoint, status)
    assert state.trainjobs[(NS, JOB)]["progressPercentage"] == 37
    # Out of range, unknown or not finite: clamped or left out, never a 422.
    odd = trainer_status({"iteration": 12, "lm_loss": float("nan"), "tokens_per_s": None, "eta_s": 1e12}, 8, observed)
    assert odd["progressPercentage"] == 100 and odd["estimatedRemainingSeconds"] == 2**31 - 1
    assert [m["name"] for m in odd["metrics"]] == ["iteration"]
    post(endpoint, odd)
    assert [r.code for r in state.received] == [200, 200]


@pytest.mark.parametrize("change, code", [
    (lambda s: {**s, "progressPercentage": 45.0}, 422),  # a float into int32: "Invalid payload"
    (lambda s: {**s, "progressPercentage": 101}, 422),
    (lambda s: {k: v for k, v in s.items() if k != "lastUpdatedTime"}, 422),  # the CEL rule
    (lambda s: {**s, "metrics": [{"name": "x", "value": "1" * 65}]}, 422),
    (lambda s: {**s, "metrics": [{"name": "x", "value": 1.5}]}, 422),
])
def test_the_model_server_refuses_what_the_trainer_refuses(trainer, change, code):
    from domino.tracking.trainer_status import StatusRejected

    state, endpoint = trainer
    with pytest.raises(StatusRejected) as raised:
        post(endpoint, change(trainer_status(record(3), 8, datetime.now(timezone.utc))))
    assert raised.value.code == code


def test_the_model_server_checks_the_token_and_path_like_the_trainer(trainer, tmp_path):
    from domino.tracking.trainer_status import StatusRejected

    state, endpoint = trainer
    status = trainer_status(record(3), 8, datetime.now(timezone.utc))
    refusals = {
        "another job's audience": state.issuer.token(NS, "other"),
        "a pod of another namespace": state.issuer.token(NS, JOB, pod_namespace="team-b"),
        "expired": state.issuer.token(NS, JOB, lifetime_s=-1),
        "signed by another key": TokenIssuer().token(NS, JOB),
    }
    for why, token in refusals.items():
        rotate(endpoint.token, token)
        with pytest.raises(StatusRejected, match="HTTP 403: Forbidden"):
            post(endpoint, status)
    rotate(endpoint.token, state.issuer.token(NS, JOB))
    with pytest.raises(StatusRejected, match="HTTP 404: Not found"):
        post(Endpoint(endpoint.url.replace("/status", "/progress"), endpoint.ca_cert, endpoint.token), status)
    with pytest.raises(StatusRejected, match="HTTP 404: Train job not found"):
        state.trainjobs.clear()
        post(endpoint, status)


def test_the_model_server_accepts_the_kubeflow_sdks_own_request(trainer, monkeypatch):
    """Kubeflow's SDK (kubeflow 0.5.0, ``update_trainjob_status``) posts the same request to the same server."""
    from kubeflow.trainer import update_trainjob_status

    state, endpoint = trainer
    monkeypatch.setenv(URL_ENV, endpoint.url)
    monkeypatch.setenv(CA_CERT_ENV, endpoint.ca_cert)
    monkeypatch.setenv(TOKEN_ENV, endpoint.token)
    assert update_trainjob_status(progress_percent=40, estimated_remaining_seconds=12, metrics={"loss": 5.25})
    ours = state.received[-1].body["trainerStatus"]
    post(endpoint, trainer_status(record(3), 8, datetime.now(timezone.utc)))
    theirs = state.received[-1].body["trainerStatus"]
    assert [r.code for r in state.received] == [200, 200]
    assert set(ours) == set(theirs) and {type(v) for v in ours.values()} == {type(v) for v in theirs.values()}


def test_the_poster_sends_the_newest_figures_paced_and_reads_the_rotated_token(trainer):
    state, endpoint = trainer
    poster = TrainerStatusPoster(endpoint, train_iters=1000, interval_s=0.5)
    started, slowest = time.monotonic(), 0.0
    for iteration in range(1, 301):  # 3 s of records, one every 10 ms
        before = time.monotonic()
        poster.offer(record(iteration))
        slowest = max(slowest, time.monotonic() - before)
        if iteration == 150:  # the kubelet rotates the token; the server's clock then passes the old one's expiry
            old = Path(endpoint.token).read_text()
            rotate(endpoint.token, state.issuer.token(NS, JOB, lifetime_s=7200))
            rotated_at = time.time()
            state.clock_skew_s = 3700
        time.sleep(0.01)
    poster.close()
    elapsed = time.monotonic() - started
    posts = [r for r in state.received]
    assert all(r.code == 200 for r in posts), [(r.code, r.token[:10]) for r in posts]
    assert 3 <= len(posts) <= elapsed / 0.5 + 2  # paced, not one per record
    assert all(b.at - a.at >= 0.45 for a, b in zip(posts, posts[1:]))
    progress = [r.body["trainerStatus"]["progressPercentage"] for r in posts]
    assert progress == sorted(progress) and progress[-1] == 30  # the newest figures, the last one included
    assert posts[0].token == old and all(r.token != old for r in posts if r.at > rotated_at + 0.1)
    assert slowest < 0.05, slowest  # offering never waits for the network


def test_a_failing_server_is_said_once_and_backed_off(trainer, caplog):
    state, endpoint = trainer
    state.fail_with = 500
    poster = TrainerStatusPoster(endpoint, train_iters=100, interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="domino.tracking.trainer_status"):
        for iteration in range(1, 61):
            poster.offer(record(iteration))
            time.sleep(0.05)  # 3 s
        poster.close(wait_s=0.5)
    attempts = [r for r in state.received]
    assert all(r.code == 500 for r in attempts)
    assert 2 <= len(attempts) <= 5  # backing off 0.4, 0.8, 1.6 s..., not every 0.2 s
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # the first failure, and the run's count at the end
    assert "not posted (StatusRejected: HTTP 500: Internal error)" in said[0]
    assert f"{len(attempts)} of {len(attempts)} posts failed in this run" in said[1]


def _run_pretrain(tmp_path, endpoint: Endpoint, iters: int, interval: int, timeout: float = 240):
    metrics = tmp_path / "m.jsonl"
    env = child_env({URL_ENV: endpoint.url, CA_CERT_ENV: endpoint.ca_cert or "", TOKEN_ENV: endpoint.token})
    proc = subprocess.Popen(pretrain_command([*BASE, "--train-iters", str(iters), "--log-interval", str(interval),
                                              "--metrics-file", str(metrics), "--save", str(tmp_path / "ckpt")]),
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, metrics


def test_pretrain_posts_its_progress_eta_and_metrics_to_the_trainjob(trainer, tmp_path):
    state, endpoint = trainer
    proc, metrics = _run_pretrain(tmp_path, endpoint, iters=1500, interval=10)
    rotated_at = None
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if rotated_at is None and state.received:  # the first post is in: the token rotates
                old = Path(endpoint.token).read_text()
                rotate(endpoint.token, state.issuer.token(NS, JOB, lifetime_s=7200))
                rotated_at, state.clock_skew_s = time.time(), 3700  # and the old one expires
            time.sleep(0.05)
        stderr = proc.communicate(timeout=30)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    posts = list(state.received)
    assert len(posts) >= 3 and all(r.code == 200 for r in posts), [(r.code, r.body) for r in posts]
    assert all(b.at - a.at >= INTERVAL_S - 0.2 for a, b in zip(posts, posts[1:]))  # the Trainer's pace
    assert posts[0].token == old and all(r.token != old for r in posts[1:])
    records = {r["iteration"]: r for r in read_metrics(metrics) if "eval" not in r}
    progress = []
    for post_ in posts:
        status = post_.body["trainerStatus"]
        values = {m["name"]: m["value"] for m in status["metrics"]}
        iteration = int(values["iteration"].split("/")[0])
        assert values["iteration"] == f"{iteration}/1500"
        r = records[iteration]
        assert status["progressPercentage"] == 100 * iteration // 1500
        assert status["estimatedRemainingSeconds"] == round(r["eta_s"])
        assert float(values["loss"]) == pytest.approx(r["lm_loss"], rel=1e-5)
        assert float(values["tokens_per_s"]) == pytest.approx(r["tokens_per_s"], rel=1e-5)
        assert float(values["goodput"]) == pytest.approx(r["goodput"], rel=1e-5) and 0 < r["goodput"] <= 1
        progress.append(status["progressPercentage"])
    assert progress == sorted(set(progress))  # strictly increasing
    assert progress[-1] == 100 and posts[-1].body["trainerStatus"]["estimatedRemainingSeconds"] == 0
    assert state.trainjobs[(NS, JOB)]["progressPercentage"] == 100


@pytest.mark.parametrize("how", ["answers 500", "hangs", "unreachable"])
def test_pretrain_is_never_failed_nor_stalled_by_the_status_server(trainer, tmp_path, how):
    state, endpoint = trainer
    listener = None
    if how == "answers 500":
        state.fail_with = 500
    elif how == "hangs":
        listener, port = silent_listener()
        endpoint = Endpoint(f"https://localhost:{port}{PATH}", endpoint.ca_cert, endpoint.token)
    else:
        listener, port = silent_listener()
        listener.close()  # nothing listens there now
        endpoint = Endpoint(f"https://localhost:{port}{PATH}", endpoint.ca_cert, endpoint.token)
    try:
        proc, metrics = _run_pretrain(tmp_path, endpoint, iters=60, interval=1)
        stderr = proc.communicate(timeout=120)[1]
        ended = time.time()
    finally:
        if listener is not None:
            listener.close()
    assert proc.returncode == 0, stderr[-3000:]
    records = [r for r in read_metrics(metrics) if "eval" not in r]
    assert [r["iteration"] for r in records] == list(range(1, 61))
    assert max(r["iteration_time_s"] for r in records) < 1.0  # no step waited for the server (timeout 5 s)
    assert ended - metrics.stat().st_mtime < 6 + 4  # the end waits for the last post at most CLOSE_WAIT_S
    assert stderr.count("not posted") == 1, stderr[-3000:]
    if how == "answers 500":
        assert state.received and all(r.code == 500 for r in state.received)
