"""Checkpoint savers for the training loop: synchronous, or ``--async-save`` (the step goes on while it writes).

Both run the phases of :mod:`domino.checkpoint.checkpointing` (prepare, snapshot, write, commit); the
asynchronous saver moves the write off the critical path:

1. **Snapshot** (training thread, at a step boundary): every tensor this rank writes (under ZeRO its own
   fragments of the optimizer state, :mod:`domino.checkpoint.fragment_io`: no collective) is copied to host
   memory the training cannot change: on a GPU into pinned memory with non-blocking copies (torch's caching host
   allocator keeps the pinned blocks for the next save), and a CUDA event the writer waits on, so the training
   thread never waits for the device.
2. **Write** (one background thread per save): this rank's files, their fsync and its manifest part. DCP's
   collectives (planning, finishing) run on a gloo process group of their own, so they never interleave with
   the training's collectives on one group (gloo orders a group's collectives by the order of their calls).
3. **Commit** (training thread, at a later step boundary): every step while a save is in flight, the ranks
   all-reduce "my part is durable" on a second gloo group (on the host: no device synchronisation); when every
   rank's is, the outcome is agreed and rank 0 seals, renames and moves ``latest``, as a synchronous save does.
   No rank decides alone: a rank whose write failed stops every rank with the same one-line error.

At most one save is in flight: the next save, SIGTERM and the end of training wait for it. A crash at any
moment leaves ``latest`` naming the previous complete checkpoint (nothing is renamed before every part is
durable). A run that fails otherwise abandons the save in flight (its writer thread is a daemon): the
temporary directory stays uncommitted and the next run sweeps it at its start (:mod:`domino.checkpoint.leftovers`);
with ``--inprocess-restart`` each rank waits for its writer instead (:meth:`AsyncCheckpointSaver.park`) and the
restarted attempt commits and resumes that save when every rank's part was written
(:mod:`domino.checkpoint.inflight`).

Why a thread and not DCP's ``async_save`` (torch 2.13 ``state_dict_saver.py``, marked experimental): that
covers only DCP's files (here the optimizer state), while the model's safetensors shards, the RNG files and the
manifest digests must be written in the background too; and its default stager copies the state to the CPU a
second time, after domino's snapshot has already copied it off the device. Megatron-LM's ``--async-save``
(``megatron/core/dist_checkpointing/strategies/async_utils.py``: ``AsyncCallsQueue``) follows the same
pattern: a background writer, a done flag all-reduced at each step (``maybe_finalize_async_save`` of
``megatron/training/async_utils.py``, called from ``train`` in ``megatron/training/training.py``), rank 0's
finalisation writing the tracker file once every rank is done.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from domino.checkpoint import checkpointing, inflight, on_disk
from domino.config import DominoConfig
from domino.runtime.mesh import ParallelMesh, collective_device
from domino.runtime.agreement import AgreedFailure, agree

logger = logging.getLogger(__name__)


class CheckpointSaver:
    """Saves synchronously: :meth:`save` returns once the checkpoint is committed.

    Args:
        writer: the run's writer token (:func:`domino.checkpoint.save_root.hold`), naming its temporary directories.
    """

    def __init__(self, config: DominoConfig, mesh: ParallelMesh, writer: str) -> None:
        self.config, self.mesh, self.writer = config, mesh, writer

    def save(self, optimizer, iteration: int, consumed_samples: int, padded_vocab_size: int, tokenizer=None,
             global_batch_size: Optional[int] = None, schedule: Optional[dict] = None) -> Path:
        """Saves checkpoint ``iter_{iteration}`` (collective); returns its final directory."""
        return checkpointing.save_checkpoint(optimizer, self.config, self.mesh, iteration, consumed_samples,
                                             padded_vocab_size, self.writer, tokenizer,
                                             global_batch_size=global_batch_size, schedule=schedule)

    def poll(self) -> Optional[Path]:
        """Called at every step boundary on every rank: commits a finished background save (none here)."""
        return None

    def wait(self) -> Optional[Path]:
        """Waits for the save in flight and commits it (none here)."""
        return None

    def park(self) -> None:
        """After a failed attempt, before an in-process restart: keeps the save in flight (none here)."""


class _Pending:
    """A save being written by this rank's background thread."""

    def __init__(self, snapshot: checkpointing.Snapshot) -> None:
        self.snapshot = snapshot
        self.done = threading.Event()
        self.step = f"saving checkpoint {snapshot.tag}"
        self.error: Optional[BaseException] = None
        self.started = time.perf_counter()
        self.thread: Optional[threading.Thread] = None


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``tensor`` that the training cannot change (pinned, non-blocking on a GPU)."""
    if tensor.device.type == "cpu":
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    # Launch: a device-to-host copy on the current stream; the writer waits for it (Snapshot.copied) before
    # reading, and later kernels on the stream that change the source run after it.
    out.copy_(tensor.detach(), non_blocking=True)
    return out


def _copies_landed():
    """What the writer calls before it reads the host copies: a wait on an event after them, on a GPU."""
    if collective_device().type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()  # after every copy launched by host_copy on this stream
    return event.synchronize  # wait: in the writer thread, never on the training thread


class AsyncCheckpointSaver(CheckpointSaver):
    """``--async-save``: :meth:`save` returns after the snapshot; the files are written in the background and
    committed by a later :meth:`poll` (or :meth:`wait`) once every rank's part is durable."""

    def __init__(self, config: DominoConfig, mesh: ParallelMesh, writer: str) -> None:
        super().__init__(config, mesh, writer)
        self._pending: Optional[_Pending] = None
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._write_group = self._agree_group = None
        if self._world > 1:
            timeout = timedelta(minutes=config.parallel.distributed_timeout_minutes)
            # Two host-side groups over every rank, made in the same order on each (new_group is collective):
            # DCP's collectives in the writer thread, and the training thread's done-checks and agreements.
            self._write_group = dist.new_group(backend="gloo", timeout=timeout)
            self._agree_group = dist.new_group(backend="gloo", timeout=timeout)

    def save(self, optimizer, iteration: int, consumed_samples: int, padded_vocab_size: int, tokenizer=None,
             global_batch_size: Optional[int] = None, schedule: Optional[dict] = None) -> Path:
        """Waits for the previous save, snapshots this one and starts writing it (collective); returns the
        directory it will have once committed."""
        self.wait()  # at most one save in flight
        checkpointing.prepare(self.config, iteration, optimizer, self.writer, group=self._agree_group)
        snapshot = None

        def take():
            nonlocal snapshot
            snapshot = checkpointing.take_snapshot(optimizer, self.config, self.mesh, iteration, consumed_samples,
                                                   padded_vocab_size, self.writer, tokenizer, global_batch_size,
                                                   schedule, host_copy)
            snapshot.copied = _copies_landed()

        try:
            checkpointing.collective(f"saving checkpoint {on_disk.checkpoint_tag(iteration)} (copying its state)",
                                     take, group=self._agree_group)
        except AgreedFailure as failure:
            raise checkpointing.discard(snapshot or checkpointing.empty_snapshot(self.config, iteration, self.writer),
                                        failure, self.config) from None
        self._pending = _Pending(snapshot)
        self._pending.thread = threading.Thread(target=self._write, args=(self._pending,), daemon=True,
                                                name=f"domino-save-{snapshot.tag}")
        # Launch: this rank's files written in the background; waited for in poll() (all ranks done), wait() or
        # park().
        self._pending.thread.start()
        return snapshot.final

    def _write(self, pending: _Pending) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        snapshot = pending.snapshot
        try:
            if snapshot.copied is not None:
                snapshot.copied()  # wait: the device-to-host copies of the snapshot
            pending.step = f"saving checkpoint {snapshot.tag} (optimizer state)"
            try:
                files = checkpointing.write_optimizer(snapshot, group=self._write_group)
            except CheckpointException as caught:  # on every rank; each reports its own failure, if any
                pending.error = checkpointing.own_failure(caught)
                return
            pending.step = f"saving checkpoint {snapshot.tag}"
            checkpointing.write_rest(snapshot, files)
        except BaseException as error:  # noqa: BLE001  (reported by every rank's agreement in _finish)
            pending.error = error
        finally:
            pending.done.set()

    def poll(self) -> Optional[Path]:
        """At a step boundary (every rank, every step): commits the save in flight once every rank's part is
        durable; returns its directory then, else None."""
        if self._pending is None:
            return None
        flag = torch.tensor([1 if self._pending.done.is_set() else 0], dtype=torch.int32)
        if self._world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._agree_group)  # on the host, over gloo
        return self._finish() if int(flag) else None

    def wait(self) -> Optional[Path]:
        """Waits for this rank's part of the save in flight, then commits it as :meth:`poll` does (every rank,
        at the same step boundary: before the next save, on SIGTERM, at the end of training)."""
        if self._pending is None:
            return None
        self._pending.done.wait()  # wait: this rank's background writer
        return self._finish()

    def park(self) -> None:
        """After a failed attempt, before an in-process restart leaves the process groups: waits for this rank's
        writer to end and keeps what it wrote for the restarted attempt (:mod:`domino.checkpoint.inflight`)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        timeout = 60.0 * self.config.parallel.distributed_timeout_minutes
        # Wait: the writer's collectives run on its own group, which every rank still holds, so every rank's
        # writer ends; joined, not only done: the thread holds this saver, and so the mesh's groups.
        pending.thread.join(timeout)
        written = not pending.thread.is_alive() and pending.error is None
        inflight.park(inflight.Parked(str(self.config.checkpoint.save), pending.snapshot.iteration, self.writer,
                                      written))
        logger.warning("kept the save of iteration %d in flight at the failure for the restart (%s)",
                       pending.snapshot.iteration, "this rank's part written" if written else
                       f"this rank's part not written: {pending.error or 'its writer did not end'}")

    def _finish(self) -> Path:
        pending, self._pending = self._pending, None

        def report() -> None:
            if pending.error is not None:
                raise pending.error

        try:
            agree(pending.step, report, group=self._agree_group)
        except AgreedFailure as failure:
            raise checkpointing.discard(pending.snapshot, failure, self.config) from None
        final = checkpointing.commit(pending.snapshot, self.config, group=self._agree_group)
        logger.info("checkpoint %s written in the background in %.2f s", pending.snapshot.tag,
                    time.perf_counter() - pending.started)
        return final


def make_saver(config: DominoConfig, mesh: ParallelMesh, writer: str) -> CheckpointSaver:
    """The saver ``--async-save`` asks for, on the run's ``mesh``, writing as ``writer`` (call on every rank: the
    asynchronous one creates process groups)."""
    c = config.checkpoint
    return (AsyncCheckpointSaver if c.async_save and c.save else CheckpointSaver)(config, mesh, writer)
