"""kfp declaration and glue of the promote step (runs only when the evaluation gate says so).

The kfp function, ``components.kfp_functions.promote_model``, is generated from :data:`COMPONENTS` (see
``components/declare.py``).
"""

from dataclasses import dataclass
from typing import Any

from components.declare import Component, Input, settings_from_values
from components.promote.step import DEFAULT_MODEL_NAME, run_promote
from components.run_settings import RunSettings, TrackingSettings


@dataclass(kw_only=True)
class PromoteSettings(TrackingSettings, RunSettings):
    """Parameters of the promote-model step."""

    registered_model_name: str = DEFAULT_MODEL_NAME
    """MLflow registered model that gets a version per promotion (with mlflow_tracking_uri)."""


COMPONENTS = (Component(
    function="promote_model",
    summary="Makes ``model`` the promoted model in ``<shared_root>/promoted.json`` (written atomically) and, with "
            "a tracking URI, the alias ``champion`` of a new version in MLflow's registry.",
    settings=PromoteSettings,
    run="components.promote.component:run",
    inputs=(
        Input("model", "Input[Model]", "The pretrain step's manifest."),
        Input("decision", "Input[Artifact]", "The evaluate step's decision (test perplexity and loss of the new "
              "model)."),
    ),
    returns=("str", "The promoted checkpoint directory."),
),)


def run(model: Any, decision: Any, **values: Any) -> str:
    """The promote-model component's body."""
    s = settings_from_values(PromoteSettings, values)
    return run_promote(s.shared_root, s.run_id, model.path, decision.path, tracking_uri=s.mlflow_tracking_uri,
                       model_name=s.registered_model_name)["checkpoint_dir"]
