"""Logic of the promote step: the gate said yes, so the new model becomes the promoted one."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Tuple

from components.layout import RunLayout
from components.manifest import read_manifest
from components.registry import PromotedModel, promote
from domino.tracking import KFP_RUN_TAG
from domino.tracking.registry import Promotion, register_promotion, volume_uri


#: The registered model of the pipeline's promotions (the pipeline's ``registered_model_name`` default).
DEFAULT_MODEL_NAME = "domino-gpt"
#: Decision fields recorded as tags of the model version.
DECISION_TAGS = ("test_ppl", "test_loss", "token_accuracy", "test_tokens", "unigram_ppl", "incumbent_ppl",
                 "incumbent_run", "reason")


def run_promote(
    shared_root: str, run_id: str, model_manifest: str, decision_manifest: str,
    log: Callable[[str], None] = print, tracking_uri: str = "", model_name: str = DEFAULT_MODEL_NAME,
) -> Dict[str, Any]:
    """Writes the model of ``model_manifest`` as the current entry of ``<shared_root>/promoted.json`` and,
    with ``tracking_uri``, registers it as a new version of ``model_name`` in MLflow, still under the
    registry's lock (the version's source: the manifest's ``checkpoint_uri``; the decision as tags; the
    alias ``champion`` moved to it).

    Raises:
        ValueError: the decision does not say promote (the pipeline's gate should have skipped this step), or
            is malformed: anything but an explicit ``"promote": true`` with finite perplexity and loss is a no.

    Returns:
        The new registry entry as plain data.
    """
    layout = RunLayout(shared_root, run_id)
    model = read_manifest(model_manifest, "model")
    decision = read_manifest(decision_manifest, "decision")
    test_ppl, test_loss = _check_decision(decision, decision_manifest)
    entry = PromotedModel(
        run_id=run_id, checkpoint_dir=model["checkpoint_dir"], test_ppl=test_ppl, test_loss=test_loss,
        iteration=int(model.get("iterations", 0)), tokens=int(model.get("tokens_seen", 0)),
    )
    promotion = Promotion(
        model_name=model_name, source=model.get("checkpoint_uri") or volume_uri(model["checkpoint_dir"], shared_root),
        run_id=str(model.get("mlflow_run_id") or ""),
        tags={**{name: decision.get(name) for name in DECISION_TAGS}, KFP_RUN_TAG: run_id,
              "checkpoint_dir": model["checkpoint_dir"], "iterations": entry.iteration, "tokens_seen": entry.tokens})
    # Re-checked under the registry's lock: another run may have been promoted since this run's gate. MLflow's
    # registry follows under the same lock, so its alias moves in the order promoted.json changes.
    written = promote(layout.registry_path, entry, gate_incumbent=str(decision.get("incumbent_run") or ""),
                      mirror=lambda _: register_promotion(tracking_uri, promotion))
    log(f"promote: run {run_id} is now the promoted model (perplexity {test_ppl:.4f}) in {layout.registry_path}")
    return written["current"]


def _check_decision(decision: Any, path: str) -> Tuple[float, float]:
    """``(test_ppl, test_loss)`` of a decision that says promote; a missing or malformed one never promotes."""
    if not isinstance(decision, dict):
        raise ValueError(f"decision {path}: expected a JSON object, got {type(decision).__name__}; not promoting")
    verdict = decision.get("promote")
    if verdict is False:
        raise ValueError(f"decision {path}: the gate did not promote this model ({decision.get('reason')})")
    if verdict is not True:  # a missing key, "false" as a string, 1, null: never read as a yes
        shown = "missing" if "promote" not in decision else repr(verdict)
        raise ValueError(f"decision {path}: field 'promote' is {shown}, expected true or false; not promoting")
    values = []
    for field in ("test_ppl", "test_loss"):
        value = decision.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"decision {path}: field {field!r} is {value!r}, expected a finite number; "
                             "not promoting")
        values.append(float(value))
    return values[0], values[1]
