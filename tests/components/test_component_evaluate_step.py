"""The evaluate step on real (randomly initialised, tiny) checkpoints: metrics, report, and the gate's
comparison with the promoted model re-evaluated on the same samples."""

import json
import os
import shutil

import pytest
import torch

from components.evaluate.step import EvaluateSettings, run_evaluate
from components.manifest import write_manifest
from components.preprocess.step import run_preprocess
from components.promote.step import run_promote
from components.registry import current_model
from domino.config import config_to_dict, padded_vocab_size, parse_config
from domino.model import GPTModel
from domino.checkpoint.model_shards import write_weights_only_checkpoint


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A shared root with a tokenized corpus and two tiny checkpoints (different random weights)."""
    root = tmp_path_factory.mktemp("shared")
    dataset = str(root / "dataset.json")
    run_preprocess(dataset, str(root), corpus="shakespeare-small")
    config = parse_config(["--preset", "tiny", "--split", "90,5,5"])
    vocab = padded_vocab_size(50257, config)
    models = {}
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        model = GPTModel(config.model, vocab)
        save_root = root / "runs" / name / "checkpoints"
        write_weights_only_checkpoint(save_root, config, model.state_dict(), vocab, iteration=5)
        metrics = root / "runs" / name / "metrics.jsonl"
        metrics.write_text("".join(json.dumps({"iteration": i, "lm_loss": 11.0 - i, "lr": 0.003,
                                               "tokens_per_s": 100.0}) + "\n" for i in (1, 2, 3)))
        manifest = str(root / f"model-{name}.json")
        write_manifest(manifest, {"checkpoint_dir": str(save_root), "metrics_file": str(metrics), "iterations": 5,
                                  "tokens_seen": 1280, "config": config_to_dict(config)})
        models[name] = manifest
    return root, dataset, models


def _settings(root, run_id):
    return EvaluateSettings(shared_root=str(root), run_id=run_id, eval_batches=2, sample_tokens=3)


def test_first_model_is_promoted_and_reported(workspace, tmp_path):
    root, dataset, models = workspace
    report = tmp_path / "report.html"
    result = run_evaluate(_settings(root, "a"), models["a"], dataset, str(report), log=lambda _: None)
    assert result["promote"] is True and result["incumbent_ppl"] is None
    assert result["reason"] == "no model promoted yet"
    assert result["test_ppl"] == pytest.approx(torch.exp(torch.tensor(result["test_loss"])).item(), rel=1e-4)
    assert result["test_ppl"] > 1000  # random weights over a 50k vocabulary
    assert 0.0 <= result["token_accuracy"] <= 1.0 and result["test_tokens"] == 2 * 16 * 64
    page = report.read_text(encoding="utf-8")
    assert "domino run a" in page and "To be, or not to be" in page and "<img" in page
    # Random weights are far worse than token frequencies, and write few words of the corpus.
    assert result["test_ppl"] > result["unigram_ppl"] > 1.0
    assert 0.0 <= result["sample_word_fraction"] <= 1.0 and len(result["samples"]) == 2
    assert "unigram baseline" in page and "What ran" in page and "temperature 0.8, top-k 40, seed 1" in page
    assert ">None<" not in page and "model location" in page


def test_gate_reevaluates_the_promoted_model_on_the_same_samples(workspace, tmp_path):
    root, dataset, models = workspace
    registry = os.path.join(root, "promoted.json")
    first = run_evaluate(_settings(root, "a"), models["a"], dataset, str(tmp_path / "r1.html"), log=lambda _: None)
    decision = str(tmp_path / "decision.json")
    write_manifest(decision, first)
    run_promote(str(root), "a", models["a"], decision, log=lambda _: None)
    assert current_model(registry).run_id == "a"

    # The same weights again: re-evaluated incumbent gives the identical perplexity, and equal is not better.
    again = run_evaluate(_settings(root, "a2"), models["a"], dataset, str(tmp_path / "r2.html"), log=lambda _: None)
    assert again["incumbent_ppl"] == pytest.approx(again["test_ppl"], rel=1e-6)
    assert again["promote"] is False and again["incumbent_run"] == "a"

    # Other weights: promoted exactly when their perplexity is lower.
    other = run_evaluate(_settings(root, "b"), models["b"], dataset, str(tmp_path / "r3.html"), log=lambda _: None)
    assert other["incumbent_ppl"] == pytest.approx(first["test_ppl"], rel=1e-6)
    assert other["promote"] is (other["test_ppl"] < first["test_ppl"])
    report = (tmp_path / "r3.html").read_text(encoding="utf-8")
    assert "promoted run a" in report  # both models in the evaluation table

    # The promoted checkpoint is gone: fall back to the recorded perplexity.
    shutil.rmtree(os.path.join(root, "runs", "a", "checkpoints"))
    fallback = run_evaluate(_settings(root, "b2"), models["b"], dataset, str(tmp_path / "r4.html"),
                            log=lambda _: None)
    assert fallback["incumbent_ppl"] == pytest.approx(current_model(registry).test_ppl)


@pytest.mark.parametrize("value", [-0.1, 1.0, 2.5, float("nan")])
def test_min_improvement_is_checked_by_the_step_a_kfp_run_calls(tmp_path, value):
    """A run from the KFP UI or API skips `domino pipeline`'s parameter checks and calls the component
    directly: the step refuses the value, naming it, before reading anything."""
    from types import SimpleNamespace

    from components.evaluate.component import run

    missing = SimpleNamespace(path=str(tmp_path / "missing"), metadata={})
    with pytest.raises(ValueError, match=r"^min_improvement: .* must be in \[0, 1\)"):
        run(model=missing, dataset=missing, metrics=missing, report=missing, decision=missing,
            shared_root=str(tmp_path), run_id="r", min_improvement=value)
    assert not (tmp_path / "missing").exists()
