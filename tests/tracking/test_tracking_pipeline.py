"""The quick local pipeline against a real MLflow server (see conftest.py), read back over REST: a promotion
registers one model version (source: the checkpoint on the volume, the evaluation as tags, alias ``champion``),
a rejection registers none and leaves the alias; each run's MLflow run and KFP run point at each other."""

from __future__ import annotations

import logging

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


def test_a_promotion_that_lost_the_race_registers_nothing_and_a_down_registry_is_not_fatal(tmp_path, mlflow_server):
    """The promote step on hand-written manifests: the registry follows promoted.json under its lock."""
    from components.manifest import write_manifest
    from components.promote.step import run_promote
    from components.registry import RegistryError, current_model
    from distributed_helpers import free_port

    model_name, root = "race-test-gpt", str(tmp_path)

    def promote(run, ppl, incumbent, uri=mlflow_server.uri):
        model, decision = tmp_path / f"{run}-model.json", tmp_path / f"{run}-decision.json"
        write_manifest(str(model), {"checkpoint_dir": f"{root}/runs/{run}/checkpoints", "iterations": 4,
                                    "checkpoint_uri": f"pvc://domino-data/runs/{run}/checkpoints/iter_0000004"})
        write_manifest(str(decision), {"promote": True, "test_ppl": ppl, "test_loss": 1.0, "reason": "better",
                                       "incumbent_run": incumbent})
        return run_promote(root, run, str(model), str(decision), log=lambda _: None, tracking_uri=uri,
                           model_name=model_name)

    def champion():
        return mlflow_server.get("registered-models/alias", name=model_name, alias="champion")["model_version"]

    promote("a", 10.0, "")
    assert champion()["source"] == "pvc://domino-data/runs/a/checkpoints/iter_0000004"
    # b's gate saw no model, but a was promoted since and is better: b loses, MLflow gets nothing.
    with pytest.raises(RegistryError, match="run a .* was promoted after the gate compared run b"):
        promote("b", 12.0, "")
    assert len(mlflow_server.versions(model_name)) == 1 and champion()["version"] == "1"
    promote("c", 8.0, "a")
    assert champion()["version"] == "2" and not champion().get("run_id")  # trained without tracking

    # The registry is down: promoted.json still moves, the step succeeds, the warning is said once.
    stopped = f"http://127.0.0.1:{free_port()}"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("domino.tracking.registry").addHandler(handler)
    try:
        promote("d", 7.0, "c", uri=stopped)
    finally:
        logging.getLogger("domino.tracking.registry").removeHandler(handler)
    assert current_model(f"{root}/promoted.json").run_id == "d"
    said = [r.getMessage() for r in records if "MLflow registry" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"MLflow registry at {stopped} unavailable") and "champion" in said[0]
    assert champion()["version"] == "2"
