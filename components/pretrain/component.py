"""kfp declaration and glue of the pretrain step (logic in ``step.py``, parameters in ``settings.py``).

The kfp function itself, ``components.kfp_functions.pretrain``, is generated from :data:`COMPONENTS` (see
``components/declare.py`` for why kfp needs it written out).
"""

from typing import Any

from components.declare import Component, Input, settings_from_values
from components.pretrain.settings import PretrainSettings
from components.pretrain.step import metric_values, run_pretrain

COMPONENTS = (Component(
    function="pretrain",
    summary="Trains a GPT model with a distributed ``domino pretrain`` job (PyTorchJob, TrainJob, or local processes).",
    settings=PretrainSettings,
    run="components.pretrain.component:run",
    inputs=(
        Input("dataset", "Input[Dataset]", "The preprocess step's manifest (its ``prefix`` becomes ``--data-path``)."),
        Input("model", "Output[Model]", "Manifest of the final checkpoint (on the shared volume); metadata: "
              "iterations, tokens_seen, final losses, checkpoint_dir, checkpoint_uri (pvc://<claim>/<path>), job, "
              "mlflow_run_id (with mlflow_tracking_uri)."),
        Input("metrics", "Output[Metrics]", "final_train_loss, final_valid_loss, tokens_per_s, mfu, "
              "tflops_per_device, iterations."),
    ),
),)


def run(dataset: Any, model: Any, metrics: Any, **values: Any) -> None:
    """The component's body: runs the step and fills the ``model`` and ``metrics`` artifacts."""
    summary = run_pretrain(settings_from_values(PretrainSettings, values), dataset.path, model.path)
    model.metadata.update({key: value for key, value in summary.items() if key != "config"})
    for name, value in metric_values(summary).items():
        metrics.log_metric(name, value)
