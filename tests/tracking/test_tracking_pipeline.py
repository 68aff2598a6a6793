"""The quick local pipeline against a real MLflow server (see conftest.py), read back over REST: a promotion
registers one model version (source: the checkpoint on the volume, the evaluation as tags, alias ``champion``),
a rejection registers none and leaves the alias; each run's MLflow run and KFP run point at each other."""

from __future__ import annotations

import pytest

from pipelines.local_run import QUICK_PARAMS, run_local

MODEL = "tracking-test-gpt"


@pytest.mark.timeout(900)
def test_quick_pipeline_registers_one_version_per_promotion_and_none_after_a_rejection(tmp_path, mlflow_server):
    params = {**QUICK_PARAMS, "corpus": "shakespeare-small", "tokenizer_vocab_size": 512, "train_iters": 4,
              "log_interval": 2, "eval_interval": 2, "eval_iters": 1, "eval_batches": 1, "sample_tokens": 0,
              "mlflow_tracking_uri": mlflow_server.uri, "registered_model_name": MODEL}
    out = tmp_path / "pipeline"

    first = run_local(str(out), params, log=lambda _: None)
    assert first.promoted
    run_id = first.train["mlflow_run_id"]  # the MLflow run on the KFP outputs (the Model's metadata)
    assert first.test["mlflow_run_id"] == run_id
    assert mlflow_server.tags(run_id)["kfp.run_id"] == first.run_id  # and the KFP run on the MLflow run
    assert mlflow_server.history(run_id, "evaluate lm loss ppl")[4] == pytest.approx(first.test["test_ppl"])
    assert "report.html" in mlflow_server.artifacts(run_id)
    [version] = mlflow_server.versions(MODEL)
    assert version["source"] == f"pvc://domino-data/runs/{first.run_id}/checkpoints/iter_0000004"
    assert version["run_id"] == run_id
    tags = {t["key"]: t["value"] for t in version.get("tags", [])}
    assert float(tags["test_ppl"]) == pytest.approx(first.test["test_ppl"]) and tags["kfp.run_id"] == first.run_id
    assert tags["reason"] == "no model promoted yet"
    alias = mlflow_server.get("registered-models/alias", name=MODEL, alias="champion")["model_version"]
    assert alias["version"] == version["version"]

    # An impossible bar: the gate rejects, the promote step does not run, the registry does not change.
    second = run_local(str(out), {**params, "min_improvement": 0.99}, log=lambda _: None)
    assert not second.promoted and not second.test["promote"]
    assert mlflow_server.tags(second.train["mlflow_run_id"])["domino.promote"] == "False"
    assert [v["version"] for v in mlflow_server.versions(MODEL)] == [version["version"]]
    alias = mlflow_server.get("registered-models/alias", name=MODEL, alias="champion")["model_version"]
    assert alias["version"] == version["version"]
