"""`domino pretrain` and `domino evaluate` against a real MLflow server (see conftest.py), read back over REST.

A TP=2 run (two torchrun ranks, Domino chunks) stops at iteration 4 (``--exit-interval``) and the same command
resumes it to 8: one MLflow run holds the resolved config as parameters, the loss curve of all 8 iterations
(equal to the metrics file's), the KFP run id, the metrics file and the checkpoint by reference; then
``domino evaluate`` logs its test metrics to that run. A run pointed at a server that is not there trains to the
end and says so once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distributed_helpers import free_port
from train_helpers import child_env, read_metrics, run_pretrain, train_losses

BASE = ["--preset", "tiny", "--split", "90,5,5", "--log-interval", "1", "--num-workers", "0", "--seed", "7",
        "--eval-iters", "1", "--eval-interval", "4"]


@pytest.mark.timeout(900)
def test_tp2_run_logs_params_and_loss_curve_and_its_resume_continues_the_run(tmp_path, mlflow_server,
                                                                            corpus_prefix):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = [*BASE, "--data-path", corpus_prefix, "--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--train-iters", "8",
            "--exit-interval", "4", "--save", str(save), "--load", str(save), "--metrics-file", str(metrics),
            "--mlflow-experiment-name", "tracking-test"]
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri, "DOMINO_KFP_RUN_ID": "kfp-run-123"}

    first = run_pretrain(args, nproc=2, timeout=600, env=env)
    pointer = json.loads((save / ".mlflow-run.json").read_text())
    run_id = pointer["run_id"]
    assert pointer["tracking_uri"] == mlflow_server.uri
    assert sorted(mlflow_server.history(run_id, "lm loss")) == [1, 2, 3, 4]
    assert "MLflow" not in first.stderr.replace(f"MLflow: run {run_id}", "")  # no warning, only the run line

    run_pretrain([*args, "--exit-interval", "8"], nproc=2, timeout=600, env=env)
    assert json.loads((save / ".mlflow-run.json").read_text())["run_id"] == run_id  # the same MLflow run

    run = mlflow_server.run(run_id)
    assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"] == "kfp-run-123"
    experiment = mlflow_server.get("experiments/get-by-name", experiment_name="tracking-test")["experiment"]
    assert run["info"]["experiment_id"] == experiment["experiment_id"]
    # The loss curve: every iteration of both parts, equal to the metrics file's (Megatron's tag names).
    assert mlflow_server.history(run_id, "lm loss") == pytest.approx(train_losses(metrics), rel=1e-6)
    records = [r for r in read_metrics(metrics) if "eval" not in r]
    assert sorted(mlflow_server.history(run_id, "learning-rate")) == list(range(1, 9))
    assert mlflow_server.history(run_id, "tokens-per-second")[8] == pytest.approx(records[-1]["tokens_per_s"])
    for name in ("grad-norm", "iteration-time", "throughput", "lm loss validation", "lm loss validation ppl"):
        assert mlflow_server.history(run_id, name), name
    # Parameters: the resolved config, once (the first part's), with what the world derived.
    params = mlflow_server.params(run_id)
    assert params["tensor_model_parallel_size"] == "2" and params["domino_chunks"] == "2"
    assert params["num_layers"] == "2" and params["world_size"] == "2" and params["exit_interval"] == "4"
    assert params["zero_stage"] == "0" and params["mlflow_experiment_name"] == "tracking-test"
    tags = mlflow_server.tags(run_id)
    assert tags["kfp.run_id"] == "kfp-run-123" and tags["domino.resumed_at_iteration"] == "4"
    assert tags["domino.checkpoint_dir"] == str(save)
    assert "metrics.jsonl" in mlflow_server.artifacts(run_id)

    evaluated = subprocess.run([sys.executable, "-m", "domino", "evaluate", "--load", str(save), "--eval-iters", "1",
                                "--json", "--no-progress"], env=child_env(env), capture_output=True, text=True,
                               timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert mlflow_server.history(run_id, "evaluate lm loss ppl")[8] == pytest.approx(result["ppl"])
    assert mlflow_server.history(run_id, "evaluate token accuracy")[8] == pytest.approx(result["accuracy"])


@pytest.mark.timeout(600)
def test_training_with_the_server_stopped_finishes_and_says_so_once(tmp_path, corpus_prefix):
    stopped = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a server that is down
    metrics = tmp_path / "metrics.jsonl"
    proc = run_pretrain([*BASE, "--data-path", corpus_prefix, "--train-iters", "6", "--eval-interval", "3", "--save", str(tmp_path / "ckpt"),
                         "--metrics-file", str(metrics)], timeout=300, env={"MLFLOW_TRACKING_URI": stopped})
    assert sorted(train_losses(metrics)) == [1, 2, 3, 4, 5, 6]  # the training result is complete
    said = [line for line in proc.stderr.splitlines() if "MLflow" in line]
    assert len([line for line in said if "unavailable" in line]) == 1, said
    assert f"MLflow at {stopped} unavailable while opening the training run" in said[0]
    assert "Retrying" not in proc.stderr  # urllib3's per-retry warnings are not repeated to the user
    assert not (tmp_path / "ckpt" / ".mlflow-run.json").exists()


@pytest.mark.timeout(600)
def test_training_without_the_mlflow_client_finishes_and_says_so_once(tmp_path, corpus_prefix):
    """The core trains without MLflow installed: an ``mlflow`` that cannot be imported shadows the real one."""
    shadow = tmp_path / "shadow" / "mlflow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named mlflow (shadowed by the test)')\n")
    metrics = tmp_path / "metrics.jsonl"
    pythonpath = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH")) if p)
    proc = run_pretrain([*BASE, "--data-path", corpus_prefix, "--train-iters", "2", "--eval-interval", "0",
                         "--metrics-file", str(metrics)], timeout=300,
                        env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:1", "PYTHONPATH": pythonpath})
    assert sorted(train_losses(metrics)) == [1, 2]
    said = [line for line in proc.stderr.splitlines() if "unavailable" in line]
    assert len(said) == 1 and "while importing the client (pip install 'domino[tracking]')" in said[0], said
