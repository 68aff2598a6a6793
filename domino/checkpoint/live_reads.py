"""Reading a save root that a live run writes: a checkpoint removed under its reader is read again at the new latest.

A training run deletes a checkpoint once ``latest`` names a newer one (``--keep-last``: ``_prune`` in
:mod:`domino.checkpoint.checkpointing`), and a save of an iteration already saved renames the old copy aside and
deletes it. A reader that resolved ``latest`` just before (``export-hf``, ``evaluate``, ``generate``,
``checkpoint inspect``) then finds files missing half-way and reported a damaged checkpoint ("iter_0000012 ...
lacks .../tp_rank_00.safetensors"): pruned, not damaged. :func:`read_live` tells the two apart after the failure,
from the root itself: the checkpoint it read has lost its ``checkpoint.json`` (deleted since it was opened) or,
read through the root, ``latest`` names another checkpoint now. Then it reads the new latest (up to
:data:`ATTEMPTS` times, a writer saving faster than a reader reads being the only way to run out), or, where it
must not read another checkpoint than the one named (an ``iter_*`` directory given, or several processes that
would each decide alone), says in one line that the checkpoint was removed and which one is the latest now.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Callable, Optional, TypeVar, Union

import torch.distributed as dist

from domino.checkpoint.on_disk import META_FILE, Checkpoint, CheckpointError, PathLike, read_latest

logger = logging.getLogger(__name__)

T = TypeVar("T")
ATTEMPTS = 3


class CheckpointRemoved(CheckpointError):
    """The checkpoint being read was pruned or replaced by the run writing its save root."""


def _newer_latest(ckpt: Checkpoint, through_root: bool) -> Optional[str]:
    """The checkpoint the root's ``latest`` names now, when ``ckpt`` was removed or superseded while it was read;
    None when it was not (the failure is the checkpoint's own)."""
    try:
        now = read_latest(ckpt.path.parent)
    except (CheckpointError, OSError):
        return None
    if now is None or now.name == ckpt.name:
        return None
    deleted = not (ckpt.path / META_FILE).is_file()  # checkpoint.json was read when it was opened
    return now.name if deleted or through_root else None


def read_live(load: Union[PathLike, Checkpoint], read: Callable[[Checkpoint], T], retry: bool = True,
              suspect: Optional[Callable[[T], bool]] = None) -> T:
    """``read(Checkpoint.open(load))``, read again at the root's new latest when the checkpoint was removed under it.

    Args:
        load: a save root (its ``latest``), an ``iter_*`` directory, or a checkpoint already opened.
        read: reads the checkpoint (everything that touches its files).
        retry: read the new latest (:func:`one_process`); False says the checkpoint was removed instead (ranks
            that would each decide alone).
        suspect: whether a result that ``read`` returns may come from files vanishing under it (``checkpoint
            inspect``'s verdict "DAMAGED", or "unverified" for a manifest gone), checked as a raised error is.

    Raises:
        CheckpointRemoved: the checkpoint was removed while it was read and is not read again.
    """
    through_root = not isinstance(load, Checkpoint) and not (Path(load) / META_FILE).is_file()
    for attempt in itertools.count(1):
        ckpt = Checkpoint.open(load)
        try:
            result = read(ckpt)
        except Exception:
            newer = _newer_latest(ckpt, through_root)
            if newer is None:
                raise
        else:
            newer = _newer_latest(ckpt, through_root) if suspect is not None and suspect(result) else None
            if newer is None:
                return result
        root = ckpt.path.parent
        if not (retry and through_root) or attempt == ATTEMPTS:
            raise CheckpointRemoved(f"{ckpt.path} was removed while it was read (pruned or replaced by the run "
                                    f"writing {root}); {root}'s latest checkpoint is now {newer}: read that")
        logger.warning("%s was removed while it was read (pruned or replaced by the run writing %s): reading %s, "
                       "the latest now", ckpt.path, root, newer)


def one_process() -> bool:
    """Whether this reader runs alone (it may then choose another checkpoint by itself): one process, also before
    its process group exists (torchrun's ``WORLD_SIZE``)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return world == 1
