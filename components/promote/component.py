"""kfp wrapper of the promote step (runs only when the evaluation gate says so)."""

from typing import Optional

from kfp import dsl
from kfp.dsl import Artifact, Input, Model

from components import default_image


def promote_model(model: Input[Model], decision: Input[Artifact], shared_root: str, run_id: str) -> str:
    """Makes ``model`` the promoted model in ``<shared_root>/promoted.json`` (written atomically).

    Args:
        model: The pretrain step's manifest.
        shared_root: Mount path of the shared volume.
        run_id: Unique run id.
        decision: The evaluate step's decision (test perplexity and loss of the new model).

    Returns:
        The promoted checkpoint directory.
    """
    from components.promote.step import run_promote

    return run_promote(shared_root, run_id, model.path, decision.path)["checkpoint_dir"]


def build(image: Optional[str] = None):
    """The promote component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(promote_model, base_image=image or default_image(), install_kfp_package=False)
