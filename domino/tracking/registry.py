"""Promoted models in MLflow's model registry: one version per promotion, an alias on the promoted one.

``promoted.json`` on the shared volume stays the source of truth (the gate reads it, warm starts read it,
and it works without a server). The promote step calls :func:`register_promotion` while it still holds the
registry file's lock, after the file names the new model: so versions are created only for promotions that
won, and the alias moves in the same order as ``promoted.json`` (two promote steps never interleave). The
calls are synchronous, each bounded by MLflow's HTTP settings (``session.apply_http_defaults``); after the
first failure the rest are skipped, said once, and nothing is raised.

A version's ``source`` is the checkpoint where it lies, by reference: ``pvc://<claim>/<path in the claim>``
for a checkpoint on the pipeline's shared volume (MLflow stores the string; its server refuses plain local
paths as sources unless they lie inside the run's artifact folder, ``_validate_source_run`` in
``mlflow/server/handlers.py``, mlflow 3.17.2, and accepts other schemes).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from domino.redact import redact_text, redact_uri
from domino.tracking.session import apply_http_defaults

logger = logging.getLogger(__name__)

#: The alias moved to each newly promoted version (MLflow aliases replace the "Production" stage).
DEFAULT_ALIAS = "champion"


def volume_uri(path: str, volume_root: str, claim: str = "") -> str:
    """``pvc://<claim>/<path relative to volume_root>`` for a path on the shared volume ``claim``; the absolute
    path as a ``file://`` URI otherwise."""
    path, volume_root = os.path.abspath(path), os.path.abspath(volume_root)
    if claim and os.path.commonpath([path, volume_root]) == volume_root:
        return f"pvc://{claim}/{os.path.relpath(path, volume_root)}"
    return f"file://{path}"


@dataclass
class Promotion:
    """What the registry records of one promotion.

    Attributes:
        model_name: The registered model.
        source: Where the checkpoint lies (:func:`volume_uri`).
        run_id: The MLflow run that trained it ('' when training was not tracked).
        tags: The evaluation and decision (perplexities, reason, KFP run id, ...), as version tags.
        alias: Moved to the new version.
    """

    model_name: str
    source: str
    run_id: str = ""
    tags: Dict[str, Any] = field(default_factory=dict)
    alias: str = DEFAULT_ALIAS


def register_promotion(uri: Optional[str], promotion: Promotion) -> Optional[str]:
    """Registers the promoted checkpoint as a new version and moves the alias to it.

    Returns:
        The new version (as text), or None when ``uri`` is empty or the registry could not be reached (said in
        one warning).
    """
    if not uri:
        return None
    apply_http_defaults()
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        _ensure_registered_model(client, promotion.model_name)
        version = client.create_model_version(
            promotion.model_name, promotion.source, run_id=promotion.run_id or None,
            tags={str(k): str(v) for k, v in promotion.tags.items() if v is not None and v != ""})
        client.set_registered_model_alias(promotion.model_name, promotion.alias, version.version)
    except Exception as error:  # noqa: BLE001 - the registry is a mirror of promoted.json; never fatal
        text = redact_text(" ".join(str(error).split()))[:300]
        logger.warning("MLflow registry at %s unavailable (%s: %s): model %s not registered, alias '%s' not moved; "
                       "promoted.json names the promoted model", redact_uri(uri), type(error).__name__, text,
                       promotion.model_name, promotion.alias)
        return None
    logger.info("MLflow registry: %s version %s (%s) is '%s'", promotion.model_name, version.version,
                promotion.source, promotion.alias)
    return str(version.version)


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        try:
            client.create_registered_model(name, description="GPT checkpoints promoted by domino's pipeline gate.")
        except MlflowException as race:
            if race.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
