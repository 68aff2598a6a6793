"""Logic of the promote step: the gate said yes, so the new model becomes the promoted one."""

from __future__ import annotations

from typing import Any, Callable, Dict

from components.layout import RunLayout
from components.manifest import read_manifest
from components.registry import PromotedModel, promote


def run_promote(
    shared_root: str, run_id: str, model_manifest: str, decision_manifest: str,
    log: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Writes the model of ``model_manifest`` as the current entry of ``<shared_root>/promoted.json``.

    Raises:
        ValueError: the decision does not say promote (the pipeline's gate should have skipped this step).

    Returns:
        The new registry entry as plain data.
    """
    layout = RunLayout(shared_root, run_id)
    model = read_manifest(model_manifest, "model")
    decision = read_manifest(decision_manifest, "decision")
    if not decision.get("promote"):
        raise ValueError(f"decision {decision_manifest}: the gate did not promote this model ({decision.get('reason')})")
    test_ppl, test_loss = float(decision["test_ppl"]), float(decision["test_loss"])
    entry = PromotedModel(
        run_id=run_id, checkpoint_dir=model["checkpoint_dir"], test_ppl=float(test_ppl), test_loss=float(test_loss),
        iteration=int(model.get("iterations", 0)), tokens=int(model.get("tokens_seen", 0)),
    )
    written = promote(layout.registry_path, entry)
    log(f"promote: run {run_id} is now the promoted model (perplexity {test_ppl:.4f}) in {layout.registry_path}")
    return written["current"]
