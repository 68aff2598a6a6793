"""``domino pipeline run`` tracks to ``$MLFLOW_TRACKING_URI`` (MLflow's own convention) when no
``mlflow_tracking_uri`` parameter is given, and a given parameter (even empty: tracking off) wins."""

from __future__ import annotations

import argparse

import pytest

import pipelines.local_run
from pipelines.cli import run_command


@pytest.fixture
def captured(monkeypatch):
    seen = {}
    monkeypatch.setattr(pipelines.local_run, "run_local", lambda out, values: seen.update(values))
    return seen


def _run(params):
    return run_command(argparse.Namespace(quick=True, param=params, output_dir="unused"))


def test_the_environment_gives_the_uri_when_no_parameter_does(monkeypatch, captured):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert _run(None) == 0
    assert captured["mlflow_tracking_uri"] == "http://mlflow.example:5000"


@pytest.mark.parametrize("given", ["http://other:5000", ""])
def test_a_given_parameter_wins(monkeypatch, captured, given):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    _run([f"mlflow_tracking_uri={given}"])
    assert captured["mlflow_tracking_uri"] == given


def test_without_either_tracking_stays_off(monkeypatch, captured):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _run(None)
    assert not captured.get("mlflow_tracking_uri")
