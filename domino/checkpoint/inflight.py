"""The save in flight at an in-process restart's failure: kept, committed by the restarted attempt, resumed.

With ``--inprocess-restart`` and ``--async-save``, a step that raises soon after a save began would otherwise
abandon that save (:mod:`domino.checkpoint.async_save`: its temporary directory is swept by the next holder of
``--save``) and the restart would go back to the save before it, although every rank has the newer state in
host memory and, most of the time, already on disk. Here the restarted attempt resumes from it instead:

1. **Park** (each rank, on the way out of the failed attempt, before it leaves its process groups): the rank
   waits for its background writer to end (:meth:`~domino.checkpoint.async_save.AsyncCheckpointSaver.park`) and
   keeps a :class:`Parked` record in this process: which iteration, the temporary directory's writer token,
   and whether its part was written. The writer runs on a gloo group of its own, which every rank still holds
   at that moment, so the writes of all ranks finish together while the training threads are stopped; waiting
   before leaving also means no writer thread still refers to a group that :func:`domino.runtime.restart.leave`
   must free.
2. **Keep the directory**: rank 0's next :func:`domino.checkpoint.save_root.hold` reuses the parked writer
   token, and the holder's sweep spares the temporary directories carrying its own token
   (:func:`domino.checkpoint.leftovers.sweep`).
3. **Settle** (:func:`settle`, every rank, over the NEW process groups, after ``--save`` is held and before
   anything is chosen or loaded): the ranks all-gather their records. Only when every rank parked the same
   iteration of the same save root and every rank's part was written is the save committed, through the
   ordinary commit (:func:`domino.checkpoint.checkpointing.commit`: rank 0 seals, renames and moves ``latest``,
   agreed). Then the newest checkpoint is that save, durable, and the ordinary choice and load read it. Any
   rank without such a record (it failed before the snapshot, or its write failed) makes every rank fall back:
   rank 0 removes the temporary directory and the run resumes the newest durable checkpoint, as without this.
   Nothing uncommitted is ever read.

Why commit and read back rather than restore from the host snapshot: the commit makes the newest state durable
too (a later crash of the whole job resumes from it, not from the save before), and the restore is the one
load path every resume takes (its checks, ZeRO's re-sharding, the data position), not a second one kept in
step with it; the read-back costs one checkpoint load, which an in-process restart pays anyway when it loads
the newest durable checkpoint. A part whose write failed is not written again from the host snapshot: the
writers finished before the groups were left, so such a failure is a real one (a full disk, a lost peer)
that a second write would meet again, and falling back is always safe.

This follows nvidia-resiliency-ext's local checkpointing (``src/nvidia_resiliency_ext/checkpointing/local/
ckpt_managers/base_manager.py``: ``find_latest`` all-gathers the checkpoint ids every rank holds and resumes the
newest iteration held by every rank), with the ranks' records in place of its local files. Megatron-LM's
in-process restart (``megatron/training/inprocess_restart.py``: its ``destroy_state`` finalizer) drops the
save in flight instead and reloads the newest checkpoint, which is what a run without ``--async-save`` does
here.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist

from domino.checkpoint import checkpointing
from domino.config import DominoConfig
from domino.runtime.agreement import AgreedFailure

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parked:
    """One rank's record of the save in flight when its attempt failed (no tensors: the files are on disk).

    Attributes:
        root: the save root (``--save``) it was written under.
        iteration: the checkpoint's iteration.
        writer: the writer token of its temporary directory (``DIR/.tmp-iter_NNNNNNN.<writer>``).
        written: whether this rank's part was written completely (its writer ended without an error).
    """

    root: str
    iteration: int
    writer: str
    written: bool


_parked: Optional[Parked] = None  # this process's, from the failed attempt to the next one's settle()


def park(record: Parked) -> None:
    """Keeps ``record`` for the restarted attempt (replacing an older one)."""
    global _parked
    _parked = record


def parked_writer(config: DominoConfig) -> Optional[str]:
    """The writer token of the save parked under ``--save``, for rank 0's next hold of the root (None if none)."""
    if _parked is not None and _parked.root == str(config.checkpoint.save):
        return _parked.writer
    return None


def choose(records: List[Optional[Parked]]) -> Optional[Parked]:
    """The save every rank can resume (every rank's record the same checkpoint, every part written), else None."""
    first = records[0]
    if first is None or not all(r is not None and r.written for r in records):
        return None
    same = all((r.root, r.iteration, r.writer) == (first.root, first.iteration, first.writer) for r in records)
    return first if same else None


def settle(config: DominoConfig) -> Optional[int]:
    """Commits the save parked at the failure when every rank holds it complete (collective over the world's
    group, the new one; call with ``--save`` held). Returns its iteration, or None when there is none to
    resume (then nothing of it remains, and the newest durable checkpoint is resumed)."""
    global _parked
    mine, _parked = _parked, None
    if mine is not None and mine.root != str(config.checkpoint.save):
        mine = None  # another run's save root (pretrain called again in this process): not this run's to commit
    records: List[Optional[Parked]] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, mine)  # every rank's record: all decide alike
    chosen = choose(records)
    if chosen is None:
        _give_up(config, records)
        return None
    snapshot = checkpointing.empty_snapshot(config, chosen.iteration, chosen.writer)
    try:
        checkpointing.commit(snapshot, config)  # agreed; rank 0 seals, renames, moves `latest`
    except AgreedFailure as failure:
        logger.warning("could not commit the save in flight at the failure (%s): resuming the newest durable "
                       "checkpoint", failure)
        _remove(snapshot.tmp)
        return None
    logger.info("committed %s, the save in flight at the failure (every rank's part was written)", snapshot.tag)
    return chosen.iteration


def _give_up(config: DominoConfig, records: List[Optional[Parked]]) -> None:
    """Drops a save not every rank holds complete; says which ranks lacked it."""
    held = [r for r in records if r is not None]
    if not held:
        return
    lacking = [rank for rank, r in enumerate(records) if r is None or not r.written]
    logger.warning("the save in flight at the failure (iteration %d) is not resumed: rank(s) %s hold no complete "
                   "part of it; resuming the newest durable checkpoint", held[0].iteration,
                   ", ".join(map(str, lacking)) or "(parts of other checkpoints)")
    if records[0] is not None:  # rank 0's temporary directory, the one its hold kept from the sweep
        _remove(checkpointing.empty_snapshot(config, records[0].iteration, records[0].writer).tmp)


def _remove(tmp) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
