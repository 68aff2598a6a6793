"""kfp wrapper of the evaluate step (see ``step.py`` for the logic and ``README.md`` for usage)."""

from typing import Optional

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from components import default_image


def evaluate(
    model: Input[Model],
    dataset: Input[Dataset],
    metrics: Output[Metrics],
    report: Output[HTML],
    decision: Output[Artifact],
    shared_root: str,
    run_id: str,
    eval_batches: int = 8,
    # kfp runs this function's source alone, so the default is written out (= step.DEFAULT_PROMPTS, tested).
    sample_prompts: str = "To be, or not to be|In the beginning",
    sample_tokens: int = 24,
    sample_temperature: float = 0.8,
    sample_top_k: int = 40,
    min_improvement: float = 0.0,
    mlflow_tracking_uri: str = "",
) -> bool:
    """Measures test loss, perplexity and token accuracy, writes the HTML report, and gates promotion.

    Args:
        model: The pretrain step's manifest (checkpoint on the shared volume).
        dataset: The preprocess step's manifest; its test split is evaluated.
        metrics: test_loss, test_ppl, token_accuracy, test_tokens, incumbent_ppl (when a model was promoted before),
            unigram_ppl (the baseline), sample_word_fraction (corpus words in the samples), promote (1/0).
        report: HTML report: what ran, loss curves, evaluation table with a unigram baseline, sample
            generations with the share of their words found in the corpus, configuration.
        decision: JSON with every result and the gate's decision and reason (read by the promote step).
        shared_root: Mount path of the shared volume (holds the promotion registry).
        run_id: Unique run id.
        eval_batches: Test batches per evaluated model.
        sample_prompts: Prompts for the report's sample generations, separated by '|' ('\\n': line break).
        sample_tokens: Tokens generated per prompt (0: no samples).
        sample_temperature: Sampling temperature of the report's generations.
        sample_top_k: Sample among the k most likely tokens (0: all).
        min_improvement: Fraction by which the perplexity must beat the promoted model's (0: any).
        mlflow_tracking_uri: MLflow server: the results, decision and report go to the model's training run
            (its id is the decision's ``mlflow_run_id``; '': no tracking).

    Returns:
        True when the new model should replace the promoted one (the pipeline's gate).
    """
    from components.evaluate.step import EvaluateSettings, run_evaluate
    from components.manifest import write_manifest

    settings = EvaluateSettings(shared_root=shared_root, run_id=run_id, eval_batches=eval_batches,
                                sample_prompts=sample_prompts, sample_tokens=sample_tokens,
                                sample_temperature=sample_temperature, sample_top_k=sample_top_k,
                                min_improvement=min_improvement, mlflow_tracking_uri=mlflow_tracking_uri)
    result = run_evaluate(settings, model.path, dataset.path, report.path)
    write_manifest(decision.path, result)
    decision.metadata.update(result)
    for name in ("test_loss", "test_ppl", "token_accuracy", "test_tokens", "incumbent_ppl", "unigram_ppl",
                 "sample_word_fraction"):
        if result[name] is not None:
            metrics.log_metric(name, float(result[name]))
    metrics.log_metric("promote", 1.0 if result["promote"] else 0.0)
    return bool(result["promote"])


def build(image: Optional[str] = None):
    """The evaluate component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(evaluate, base_image=image or default_image(), install_kfp_package=False)
