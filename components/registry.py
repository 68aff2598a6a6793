"""The promotion registry: a small JSON file naming the currently promoted model.

The file (``<shared root>/promoted.json``) holds ``{"current": entry or null, "history": [entries]}``.
The evaluation gate reads ``current`` to compare perplexities; the promote step replaces it. Writes
go to a temporary file in the same folder, are fsynced and renamed over the old file, so a reader
sees either the old registry or the new one, never a torn file. Scheduled runs use
``max_concurrency=1``, so there is a single writer at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from domino.atomic_files import atomic_write_text


class RegistryError(ValueError):
    """The registry file exists but cannot be used; the message names the file and the problem."""


@dataclass
class PromotedModel:
    """One promoted model.

    Attributes:
        run_id: Pipeline run that trained it.
        checkpoint_dir: Its checkpoint save root (holds ``latest``).
        test_ppl: Test perplexity measured by the gate that promoted it.
        test_loss: Test loss measured by the same gate.
        iteration: Training iterations of the checkpoint.
        tokens: Training tokens the checkpoint has seen.
        promoted_at: Unix time of promotion.
    """

    run_id: str
    checkpoint_dir: str
    test_ppl: float
    test_loss: float
    iteration: int = 0
    tokens: int = 0
    promoted_at: float = 0.0

    @classmethod
    def from_dict(cls, data: Dict[str, Any], source: str) -> "PromotedModel":
        """Builds an entry from registry JSON; missing or unknown keys raise :class:`RegistryError`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(n for n in ("run_id", "checkpoint_dir", "test_ppl", "test_loss") if n not in data)
        if unknown or missing:
            raise RegistryError(f"{source}: entry has unknown keys {unknown} / lacks keys {missing}")
        return cls(**data)


def read_registry(path: str) -> Dict[str, Any]:
    """The registry at ``path`` as ``{"current": PromotedModel | None, "history": [PromotedModel]}``.

    A missing file is an empty registry. A file that is not a registry raises :class:`RegistryError`.
    """
    if not os.path.exists(path):
        return {"current": None, "history": []}
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise RegistryError(f"promotion registry {path}: unreadable ({error})") from error
    if not isinstance(data, dict) or not isinstance(data.get("history", []), list):
        raise RegistryError(f"promotion registry {path}: expected an object with 'current' and 'history'")
    current = data.get("current")
    return {
        "current": PromotedModel.from_dict(current, path) if current else None,
        "history": [PromotedModel.from_dict(item, path) for item in data.get("history", [])],
    }


def current_model(path: str) -> Optional[PromotedModel]:
    """The promoted model in the registry at ``path``, or None when nothing was promoted yet."""
    return read_registry(path)["current"]


def promote(path: str, entry: PromotedModel) -> Dict[str, Any]:
    """Makes ``entry`` the current model and appends it to the history, atomically.

    Args:
        path: Registry file; its folder is created if needed.
        entry: The model to promote; ``promoted_at`` is set to now when zero.

    Returns:
        The registry as written (plain JSON data).
    """
    registry = read_registry(path)
    if not entry.promoted_at:
        entry = dataclasses.replace(entry, promoted_at=time.time())
    history: List[PromotedModel] = registry["history"] + [entry]
    data = {"current": dataclasses.asdict(entry), "history": [dataclasses.asdict(item) for item in history]}
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data

