"""kfp declaration and glue of the evaluate step (logic in ``step.py``, usage in ``README.md``).

The kfp function, ``components.kfp_functions.evaluate``, is generated from :data:`COMPONENTS` (see
``components/declare.py``).
"""

from typing import Any

from components.declare import Component, Input, settings_from_values
from components.evaluate.step import EvaluateSettings, run_evaluate
from components.manifest import write_manifest

#: The decision's numbers that go to the ``Metrics`` artifact (when not None).
METRICS = ("test_loss", "test_ppl", "token_accuracy", "test_tokens", "incumbent_ppl", "unigram_ppl",
           "sample_word_fraction")

COMPONENTS = (Component(
    function="evaluate",
    summary="Measures test loss, perplexity and token accuracy, writes the HTML report, and gates promotion.",
    settings=EvaluateSettings,
    run="components.evaluate.component:run",
    inputs=(
        Input("model", "Input[Model]", "The pretrain step's manifest (checkpoint on the shared volume)."),
        Input("dataset", "Input[Dataset]", "The preprocess step's manifest; its test split is evaluated."),
        Input("metrics", "Output[Metrics]", "test_loss, test_ppl, token_accuracy, test_tokens, incumbent_ppl (when "
              "a model was promoted before), unigram_ppl (the baseline), sample_word_fraction (corpus words in "
              "the samples), promote (1/0)."),
        Input("report", "Output[HTML]", "HTML report: what ran, loss curves, evaluation table with a unigram "
              "baseline, sample generations with the share of their words found in the corpus, configuration."),
        Input("decision", "Output[Artifact]", "JSON with every result and the gate's decision and reason (read by "
              "the promote step)."),
    ),
    returns=("bool", "True when the new model should replace the promoted one (the pipeline's gate)."),
),)


def run(model: Any, dataset: Any, metrics: Any, report: Any, decision: Any, **values: Any) -> bool:
    """The component's body: evaluates, writes the decision and the metrics, returns the gate."""
    result = run_evaluate(settings_from_values(EvaluateSettings, values), model.path, dataset.path, report.path)
    write_manifest(decision.path, result)
    decision.metadata.update(result)
    for name in METRICS:
        if result[name] is not None:
            metrics.log_metric(name, float(result[name]))
    metrics.log_metric("promote", 1.0 if result["promote"] else 0.0)
    return bool(result["promote"])
