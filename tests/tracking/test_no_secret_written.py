"""A tracking URI's secrets (userinfo, credential-like query parameters) are never written: not in a log line,
not in the run pointer on the save root, not in MLflow parameters, not in the smoke test's lines or its probe's
command. The URI forms, then a real ``domino pretrain`` against a real server (see conftest.py) given a password
in its URI, then one against a server that is down (MLflow's own error quotes the URI)."""

from __future__ import annotations

import json
import logging

import pytest

from distributed_helpers import free_port
from domino.redact import redact_text, redact_uri
from domino.tracking.registry import Promotion, register_promotion
from domino.tracking.runs import RunPointer, read_pointer, write_pointer
from train_helpers import run_pretrain, train_losses

SECRET = "s3cretPW"
BASE = ["--preset", "tiny", "--log-interval", "1", "--num-workers", "0", "--seed", "7", "--eval-interval", "0"]


@pytest.mark.parametrize("uri, shown", [
    (f"http://alice:{SECRET}@mlflow.example:5000", "http://***@mlflow.example:5000"),
    (f"https://{SECRET}@mlflow.example/", "https://***@mlflow.example/"),  # a token as the whole userinfo
    (f"https://mlflow.example/x?access_token={SECRET}&page=2#top",
     "https://mlflow.example/x?access_token=***&page=2#top"),
    (f"https://b.s3.amazonaws.com/k?X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}&x=1",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1"),
    (f"https://a.blob.core.windows.net/c?sv=2022&sig={SECRET};API_KEY={SECRET}",
     "https://a.blob.core.windows.net/c?sv=2022&sig=***;API_KEY=***"),
    (f"http://u:{SECRET}@[::1]:5000/?Password={SECRET}", "http://***@[::1]:5000/?Password=***"),
    (f"postgresql://u:{SECRET}@db.example/mlflow", "postgresql://***@db.example/mlflow"),
    (f"alice:{SECRET}@mlflow.example:5000", "***@mlflow.example:5000"),  # no scheme
    ("file:///srv/mlruns", "file:///srv/mlruns"),
    ("databricks://my-profile", "databricks://my-profile"),
    ("/shared/mlruns/a@b", "/shared/mlruns/a@b"),  # an @ in a path is not userinfo
    ("http://127.0.0.1:5000/x@y?page=2", "http://127.0.0.1:5000/x@y?page=2"),
])
def test_a_uri_loses_its_userinfo_and_credential_parameters_and_nothing_else(uri, shown):
    assert redact_uri(uri) == shown
    assert redact_uri(shown) == shown


def test_an_mlflow_error_loses_the_password_it_quotes():
    text = f"API request to http://alice:{SECRET}@127.0.0.1:1/api/2.0/mlflow/runs/create failed with exception x"
    assert redact_text(text) == "API request to http://***@127.0.0.1:1/api/2.0/mlflow/runs/create failed with " \
                                "exception x"


def test_the_run_pointer_holds_no_secret_and_still_matches_its_server(tmp_path):
    uri = f"http://alice:{SECRET}@127.0.0.1:5000"
    write_pointer(str(tmp_path), RunPointer(uri, "1", "abc"))
    assert SECRET not in (tmp_path / ".mlflow-run.json").read_text()
    assert read_pointer(str(tmp_path), uri).run_id == "abc"  # a resume with the same URI continues the run
    assert read_pointer(str(tmp_path), "http://127.0.0.1:5001") is None


@pytest.mark.timeout(600)
def test_pretrain_with_a_password_in_the_uri_writes_it_nowhere(tmp_path, mlflow_server):
    uri = mlflow_server.uri.replace("http://", f"http://alice:{SECRET}@")  # the test server ignores basic auth
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    proc = run_pretrain([*BASE, "--mock-data", "--train-iters", "2", "--save", str(save), "--metrics-file",
                         str(metrics), "--mlflow-experiment-name", "secrets"], timeout=300,
                        env={"MLFLOW_TRACKING_URI": uri})
    pointer = json.loads((save / ".mlflow-run.json").read_text())
    assert pointer["tracking_uri"] == mlflow_server.uri.replace("http://", "http://***@")
    said = [line for line in proc.stderr.splitlines() if "MLflow" in line]
    assert said == [f"{said[0].split('MLflow')[0]}MLflow: run {pointer['run_id']} in experiment 'secrets' "
                    f"({pointer['tracking_uri']})"], said
    assert SECRET not in proc.stdout + proc.stderr
    assert SECRET not in json.dumps(mlflow_server.run(pointer["run_id"]))  # parameters and tags
    assert SECRET not in "".join(p.read_text(errors="replace") for p in save.rglob("*") if p.is_file())


@pytest.mark.timeout(600)
def test_pretrain_against_a_server_that_is_down_names_it_without_the_password(tmp_path):
    uri = f"http://alice:{SECRET}@127.0.0.1:{free_port()}"  # nothing listens there
    metrics = tmp_path / "metrics.jsonl"
    proc = run_pretrain([*BASE, "--mock-data", "--train-iters", "2", "--metrics-file", str(metrics)], timeout=300,
                        env={"MLFLOW_TRACKING_URI": uri})
    assert sorted(train_losses(metrics)) == [1, 2]
    said = [line for line in proc.stderr.splitlines() if "unavailable" in line]
    assert len(said) == 1 and f"MLflow at {redact_uri(uri)} unavailable" in said[0], said
    assert "API request to http://***@127.0.0.1" in said[0]  # MLflow's own message, redacted
    assert SECRET not in proc.stdout + proc.stderr


def test_a_registry_that_is_down_is_named_without_the_password(caplog):
    uri = f"http://alice:{SECRET}@127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="domino.tracking.registry"):
        assert register_promotion(uri, Promotion("gpt", "pvc://claim/ckpt")) is None
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert SECRET not in caplog.text
