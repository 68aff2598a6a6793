"""kfp wrapper of the promote step (runs only when the evaluation gate says so)."""

from typing import Optional

from kfp import dsl
from kfp.dsl import Artifact, Input, Model

from components import default_image


def promote_model(model: Input[Model], decision: Input[Artifact], shared_root: str, run_id: str,
                  mlflow_tracking_uri: str = "", registered_model_name: str = "domino-gpt",
                  pvc_name: str = "") -> str:
    """Makes ``model`` the promoted model in ``<shared_root>/promoted.json`` (written atomically) and, with a
    tracking URI, a new version of the registered model in MLflow with the alias ``champion``.

    Args:
        model: The pretrain step's manifest.
        shared_root: Mount path of the shared volume.
        run_id: Unique run id.
        decision: The evaluate step's decision (test perplexity and loss of the new model).
        mlflow_tracking_uri: MLflow server ('': no registry but promoted.json).
        registered_model_name: The registered model that gets the version.
        pvc_name: Claim of the shared volume, named in the version's source (``pvc://<claim>/<path>``).

    Returns:
        The promoted checkpoint directory.
    """
    from components.promote.step import run_promote

    return run_promote(shared_root, run_id, model.path, decision.path, tracking_uri=mlflow_tracking_uri,
                       model_name=registered_model_name, claim=pvc_name)["checkpoint_dir"]


def build(image: Optional[str] = None):
    """The promote component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(promote_model, base_image=image or default_image(), install_kfp_package=False)
