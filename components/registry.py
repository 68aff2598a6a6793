"""The promotion registry: a small JSON file naming the currently promoted model.

The file (``<shared root>/promoted.json``) holds ``{"current": entry or null, "history": [entries]}``.
The evaluation gate reads ``current`` to compare perplexities; the promote step replaces it. Writes
go to a temporary file in the same folder, are fsynced and renamed over the old file, so a reader
sees either the old registry or the new one, never a torn file.

Two runs may still overlap (manual runs beside a schedule, ``max_concurrency`` raised), their promote
pods on different nodes: between a run's gate and its promote step another run may promote.
:func:`promote` therefore holds an exclusive record lock on ``.promoted.json.lock`` beside the registry
(:func:`domino.file_lock.exclusive_lock`: an ``fcntl`` lock on a regular file, which NFS shares between
nodes, where a ``flock`` on the folder is local to one node) and re-checks the incumbent the gate
compared against before writing: a newer incumbent that is at least as good is never replaced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from domino.atomic_files import atomic_write_text
from domino.file_lock import exclusive_lock


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


def lock_path(path: str) -> str:
    """The lock file of the registry at ``path``: ``.<name>.lock`` in its folder (kept; see exclusive_lock)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.lock")


def promote(path: str, entry: PromotedModel, gate_incumbent: Optional[str] = None,
            mirror: Optional[Callable[[PromotedModel], None]] = None) -> Dict[str, Any]:
    """Makes ``entry`` the current model and appends it to the history, atomically and under a lock.

    Args:
        path: Registry file; its folder is created if needed.
        entry: The model to promote; ``promoted_at`` is set to now when zero.
        gate_incumbent: run id of the incumbent the gate compared against (``""``: none); None skips the
            re-check.
        mirror: Called with the entry after the file is written, still under the lock, so a mirror of the
            registry (MLflow's model registry) changes in the same order as the file; it must not raise.

    Returns:
        The registry as written (plain JSON data).

    Raises:
        RegistryError: when another run was promoted since the gate ran and is at least as good.
    """
    with exclusive_lock(lock_path(path)):
        registry = read_registry(path)
        current = registry["current"]
        if (gate_incumbent is not None and current is not None and current.run_id != gate_incumbent
                and current.test_ppl <= entry.test_ppl):
            raise RegistryError(
                f"promotion registry {path}: run {current.run_id} (perplexity {current.test_ppl:.4f}) was promoted "
                f"after the gate compared run {entry.run_id} (perplexity {entry.test_ppl:.4f}) with "
                f"{gate_incumbent or 'no model'}; not promoting")
        if not entry.promoted_at:
            entry = dataclasses.replace(entry, promoted_at=time.time())
        history: List[PromotedModel] = registry["history"] + [entry]
        data = {"current": dataclasses.asdict(entry), "history": [dataclasses.asdict(item) for item in history]}
        atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
        if mirror is not None:
            mirror(entry)
    return data
