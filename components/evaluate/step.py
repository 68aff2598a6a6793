"""Logic of the evaluate step: test metrics, the HTML report, and the promotion decision.

Plain Python, no kfp. The gate compares the new model with the currently promoted one *on the same test
documents*: when the promoted checkpoint is still on the shared volume it is re-evaluated here, so a change
of corpus or split cannot make an old number look better or worse; otherwise the perplexity recorded at
its promotion is used.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from components.layout import RunLayout
from components.run_settings import RunSettings, TrackingSettings
from components.manifest import read_manifest
from components.registry import PromotedModel, current_model
from domino.eval.settings import EvalSettings

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EvaluateSettings(TrackingSettings, RunSettings):
    """Parameters of the evaluate step (one field per component parameter)."""

    eval_batches: int = 0
    """Test batches per evaluated model (0: domino evaluate's default token budget)."""
    eval_micro_batch_size: int = EvalSettings.micro_batch_size
    """Samples per evaluation batch."""
    sample_prompts: str = "To be, or not to be|In the beginning"
    """Prompts of the report's sample generations, separated by '|' ('\\n': line break)."""
    sample_tokens: int = 24
    """Tokens generated per report prompt (0: no samples)."""
    sample_temperature: float = 0.8
    """Sampling temperature of the report's generations."""
    sample_top_k: int = 40
    """Sample among the k most likely tokens (0: all)."""
    sample_seed: int = 1
    """Seed of the report's sample generations."""
    min_improvement: float = 0.0
    """Fraction by which the test perplexity must beat the promoted model's (0: any)."""

    def eval_settings(self) -> EvalSettings:
        """The amount and batch size of each evaluation: ``eval_batches`` micro-batches, or (0) the default
        token budget of :class:`EvalSettings`."""
        return EvalSettings(eval_iters=self.eval_batches or None, micro_batch_size=self.eval_micro_batch_size)


@dataclass
class GateDecision:
    """Whether the new model replaces the promoted one, and why."""

    promote: bool
    incumbent_ppl: Optional[float]
    reason: str


def decide(new_ppl: float, incumbent: Optional[PromotedModel], incumbent_ppl: Optional[float],
           min_improvement: float = 0.0) -> GateDecision:
    """The promotion rule: promote when nothing is promoted, or when the new test perplexity is lower
    than the incumbent's by more than ``min_improvement`` (a fraction, 0.01 = 1 %).

    A non-finite new perplexity never promotes.
    """
    if not math.isfinite(new_ppl):
        return GateDecision(False, incumbent_ppl, f"new perplexity {new_ppl} is not finite")
    if incumbent is None or incumbent_ppl is None:
        return GateDecision(True, None, "no model promoted yet")
    threshold = incumbent_ppl * (1.0 - min_improvement)
    if new_ppl < threshold:
        return GateDecision(True, incumbent_ppl,
                            f"perplexity {new_ppl:.4f} beats the promoted model's {incumbent_ppl:.4f} "
                            f"(run {incumbent.run_id})")
    return GateDecision(False, incumbent_ppl,
                        f"perplexity {new_ppl:.4f} does not beat the promoted model's {incumbent_ppl:.4f} "
                        f"(run {incumbent.run_id}) by more than {min_improvement:.1%}")


def _evaluate(load: str, data_prefix: str, settings: EvaluateSettings, eval_options: Dict[str, Any]) -> Dict[str, Any]:
    from domino.eval.evaluate import evaluate_checkpoint

    return dict(evaluate_checkpoint(load, data_prefix, settings.eval_settings(), **eval_options))


def _prompts(settings: EvaluateSettings) -> List[str]:
    # "\n" in a prompt stands for a line break (speaker names in plays sit on a line of their own).
    prompts = [p.replace("\\n", "\n") for p in settings.sample_prompts.split("|") if p.strip()]
    return prompts if settings.sample_tokens > 0 else []


def run_evaluate(
    settings: EvaluateSettings, model_manifest: str, dataset_manifest: str, report_path: str,
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Evaluates the new model, decides promotion, and writes the HTML report.

    Args:
        settings: The step's parameters.
        model_manifest: Path of the pretrain step's ``Model`` artifact.
        dataset_manifest: Path of the preprocess step's ``Dataset`` artifact.
        report_path: Where to write the HTML report.
        log: Receives progress lines.

    Returns:
        ``test_loss``, ``test_ppl``, ``token_accuracy``, ``test_tokens``, ``promote``, ``incumbent_ppl``
        (None when nothing was promoted), ``incumbent_run``, ``reason``, ``test_data`` (what was evaluated),
        ``unigram_ppl`` (the baseline's test perplexity; None without a recorded split),
        ``sample_word_fraction`` (share of the samples' words found in the corpus; None without samples),
        ``samples``.
    """
    from components.evaluate.facts import run_facts, sample_quality
    from domino.eval.report import write_report
    from domino.eval.sampling import SamplingConfig

    if settings.eval_batches < 0:
        raise ValueError(f"eval_batches: {settings.eval_batches} must be at least 0 (0: a token budget)")
    if settings.eval_micro_batch_size < 1:
        raise ValueError(f"eval_micro_batch_size: {settings.eval_micro_batch_size} must be at least 1")
    # Checked here, not only by `domino pipeline` (pipelines/params.py): a run started from the KFP UI or
    # API reaches this step with whatever value was typed, and 1 or more would make promotion impossible.
    if not 0.0 <= settings.min_improvement < 1.0:
        raise ValueError(f"min_improvement: {settings.min_improvement} must be in [0, 1) (a fraction of the "
                         "promoted model's perplexity)")
    sampling = SamplingConfig(temperature=settings.sample_temperature, top_k=settings.sample_top_k)
    try:
        sampling.check()
    except ValueError as error:
        raise ValueError(f"sample settings: {error}".replace("--temperature", "sample_temperature")
                         .replace("--top-k", "sample_top_k")) from None
    layout = RunLayout(settings.shared_root, settings.run_id)
    model = read_manifest(model_manifest, "model")
    dataset = read_manifest(dataset_manifest, "dataset")
    data_prefix = dataset["prefix"]
    # Both models read the same test documents and samples: the new run's split and sample-order seed.
    config = model.get("config") or {}
    eval_options = {}
    if config:
        eval_options = {"split": config["data"]["split"], "seed": config["train"]["seed"]}
    new = _evaluate(model["checkpoint_dir"], data_prefix, settings, eval_options)
    log(f"evaluate: new model test loss {new['loss']:.4f}, perplexity {new['ppl']:.4f}")

    incumbent = current_model(layout.registry_path)
    incumbent_ppl: Optional[float] = None
    results: Dict[str, Dict[str, Any]] = {f"test (run {settings.run_id})": new}
    if incumbent is not None:
        if os.path.isdir(incumbent.checkpoint_dir):
            previous = _evaluate(incumbent.checkpoint_dir, data_prefix, settings, eval_options)
            incumbent_ppl = float(previous["ppl"])
            results[f"test (promoted run {incumbent.run_id})"] = previous
        else:
            logger.warning("promoted checkpoint %s is gone; comparing with its recorded perplexity",
                           incumbent.checkpoint_dir)
            incumbent_ppl = incumbent.test_ppl
    decision = decide(float(new["ppl"]), incumbent, incumbent_ppl, settings.min_improvement)
    log(f"evaluate: promote={decision.promote}: {decision.reason}")

    quality = sample_quality(model["checkpoint_dir"], data_prefix, eval_options.get("split"), _prompts(settings),
                             settings.sample_tokens, sampling, settings.sample_seed)
    if quality["unigram"] is not None:
        results["unigram baseline (token frequencies of the training documents)"] = quality["unigram"]
    write_report(report_path, model.get("metrics_file"), eval_results=results, config=config or None,
                 samples=quality["samples"], title=f"domino run {settings.run_id}",
                 run_info=run_facts(model, dataset, new, quality["parameters"]), notes=quality["notes"],
                 save_root=model["checkpoint_dir"])
    unigram_ppl = float(quality["unigram"]["ppl"]) if quality["unigram"] is not None else None
    result = {
        "test_loss": float(new["loss"]), "test_ppl": float(new["ppl"]),
        "token_accuracy": float(new["accuracy"]), "test_tokens": int(new.get("tokens", 0)),
        "promote": decision.promote, "incumbent_ppl": decision.incumbent_ppl,
        "incumbent_run": incumbent.run_id if incumbent else "", "reason": decision.reason,
        "test_data": str(new.get("data", "")), "unigram_ppl": unigram_ppl,
        "sample_word_fraction": quality["word_fraction"], "samples": quality["samples"],
    }
    result["mlflow_run_id"] = _log_to_training_run(settings, model, result, report_path)
    return result


def _log_to_training_run(settings: EvaluateSettings, model: Dict[str, Any], result: Dict[str, Any],
                         report_path: str) -> str:
    """The evaluation, the gate's decision and the report, logged to the MLflow run that trained the model (with
    a tracking URI; bounded, never raised); returns that run's id ('' when there is none)."""
    from domino.tracking import evaluation_scalars, tracker_of_checkpoint

    tracker = tracker_of_checkpoint(model["checkpoint_dir"], "evaluation", settings.mlflow_tracking_uri)
    if tracker is None:
        return ""
    step = int(model.get("iterations", 0))
    tracker.log_metrics(evaluation_scalars({"loss": result["test_loss"], "ppl": result["test_ppl"],
                                            "accuracy": result["token_accuracy"], "unigram_ppl": result["unigram_ppl"],
                                            "incumbent_ppl": result["incumbent_ppl"]}, step))
    tracker.set_tags({"domino.promote": result["promote"], "domino.gate_reason": result["reason"],
                      "domino.incumbent_run": result["incumbent_run"]})
    with tempfile.TemporaryDirectory() as folder:  # the artifact keeps the .html name a browser needs
        report = os.path.join(folder, "report.html")
        shutil.copyfile(report_path, report)
        tracker.log_artifact(report)
        return tracker.finish(completed=False) or ""
