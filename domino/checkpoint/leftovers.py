"""The temporary directories of interrupted saves and the trash of killed deletes: swept by the save root's holder.

A save fills ``DIR/.tmp-iter_NNNNNNN.<token>`` (``<token>``: the writing run's, :mod:`domino.checkpoint.save_root`)
and renames it into place once every rank's part is durable (:mod:`domino.checkpoint.checkpointing`). A process
killed before that rename (SIGKILL, the OOM killer, a lost node, a SIGTERM whose grace period ran out during the
save) or a run that fails while its asynchronous save is in flight leaves the directory behind, as large as a
checkpoint, and no later save reuses it (the next run has another token).

Deleting one is safe only when no live process writes into it, and that is what the exclusive lock on
``DIR/.save.lock`` proves: the run that holds it (taken at start-up, before it writes anything) removes every
``.tmp-iter_*`` in the root, with a log line (:meth:`domino.checkpoint.save_root.SaveRootLock.acquire`), but its
own: an in-process restart carries the failed attempt's writer token over, and with it the save in flight at
the failure, which the restarted attempt commits or removes (:mod:`domino.checkpoint.inflight`). A file
system without record locks is never swept.

Only ``.tmp-iter_*`` and ``.trash-iter_*`` directories are removed: never a checkpoint under its final name,
sealed or not, nor ``latest``, nor anything else in the root. A ``.tmp-iter_*`` that was sealed but not renamed
(a kill between the two) was never committed: ``latest`` names an older checkpoint, so resume never takes it
either.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import List

logger = logging.getLogger(__name__)

LEFTOVER_GLOB = ".tmp-iter_*"
TRASH_GLOB = ".trash-iter_*"


def _remove_directories(root: Path, pattern: str, spare: str = "") -> List[str]:
    removed = []
    for path in sorted(root.glob(pattern)) if root.is_dir() else ():
        if path.is_dir() and not path.is_symlink() and not (spare and path.name.endswith(spare)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def sweep(root: Path, own_token: str = "") -> List[str]:
    """Removes every interrupted save's temporary directory in ``root``; call only while holding the root
    (no other live run writes there). Returns the names removed.

    Args:
        own_token: the holder's writer token: its own temporary directories stay (an in-process restart's
            holder carries the failed attempt's token over, for the save in flight then:
            :mod:`domino.checkpoint.inflight`; a fresh token names none).
    """
    removed = _remove_directories(root, LEFTOVER_GLOB, f".{own_token}" if own_token else "")
    if removed:
        logger.warning("removed %d temporary director%s of interrupted saves from %s: %s", len(removed),
                       "y" if len(removed) == 1 else "ies", root, ", ".join(removed))
    return removed


def sweep_trash(root: Path) -> List[str]:
    """Removes the checkpoints renamed aside (``.trash-iter_*``) that a save killed while deleting them left.

    Each is a replaced or pruned checkpoint that resume never reads (:mod:`domino.checkpoint.discovery` looks
    at ``latest`` and ``iter_*`` only) and every save deletes anyway; the holder of the root removes them at its
    start, so a run that saves nothing (restarted after its last iteration) does too.
    """
    removed = _remove_directories(root, TRASH_GLOB)
    if removed:
        logger.info("removed %s from %s (checkpoints replaced or pruned, left by a save killed while deleting "
                    "them)", ", ".join(removed), root)
    return removed
