"""Atomic training checkpoints: model shards, ZeRO optimizer state, RNG states, position in the data.

Layout of a save root (model weights and ``checkpoint.json`` are ``domino.checkpoint.on_disk``'s format)::

    DIR/latest                         tag of the newest complete checkpoint, replaced last, atomically
    DIR/iter_0000100/checkpoint.json   iteration, consumed samples, TP size, padded vocab, resolved config
    DIR/iter_0000100/model/            safetensors files by TP rank and pipeline stage (model_shards)
    DIR/iter_0000100/optimizer/        the optimizer state by parameter name and global shape, any layout
                                       reads it (domino.optim.state, distributed_io)
    DIR/iter_0000100/rng/rank_00003.pt     this rank's RNG states
    DIR/iter_0000100/tokenizer/        the tokenizer, so the checkpoint is self-contained

(An optimizer without a state by name, none that a run builds, would keep format 1's ``optim/rank_00003.pt``
instead of ``optimizer/``: this rank's state, read back on the same layout only.)

A save is three phases: every rank takes a :class:`Snapshot` of its part (copied to the host: under ZeRO its own
fragments of the optimizer state, nothing gathered), writes it into ``DIR/.tmp-iter_0000100.<token>`` (the run's
writer token, :mod:`domino.checkpoint.save_root`: the root's one writer holds its lock), and once all
ranks agree that their writes succeeded, rank 0 seals and renames it into place and only then moves ``latest``
(:func:`commit`). :func:`save_checkpoint` runs them in a row; ``--async-save`` (:mod:`domino.checkpoint.async_save`)
writes in the background while training goes on. A kill at any moment, or a failed write on any rank (disk full),
therefore leaves the previous checkpoint intact and pointed to. Nothing saved needs unpickling
to be read back: safetensors, JSON, and plain tensors and numbers for ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from domino.atomic_files import atomic_write, fsync_directory
from domino.checkpoint import (discovery, distributed_io, fault_hooks, fragment_io, manifest, model_shards,
                               on_disk, per_rank_state)
from domino.optim import state as optimizer_state, state_dict
from domino.config import DominoConfig, config_to_dict
from domino.pipeline.stages import stored_name
from domino.runtime.mesh import ParallelMesh
from domino.runtime.agreement import AgreedFailure, agree

logger = logging.getLogger(__name__)

def collective(step: str, fn, group=None):
    """Runs ``fn``, a step made of collectives that fail on every rank alike, and turns a failure into the same
    one-line :class:`AgreedFailure` on every rank, naming the ranks that failed, as :func:`agree` does.

    DCP raises ``CheckpointException`` (a ``BaseException``) on every rank when any rank's reads or writes
    failed, with each failed rank's own exception in ``failures`` (``torch/distributed/checkpoint/api.py``);
    each rank reports only its own.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        result, error = fn(), None
    except CheckpointException as caught:
        result, error = None, own_failure(caught)
    except Exception as caught:  # noqa: BLE001  (re-raised inside the agreement, which names it per rank)
        result, error = None, caught

    def report():
        if error is not None:
            raise error
        return result

    return agree(step, report, group=group)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    try:
        with atomic_write(str(path)) as handle:
            torch.save(obj, handle)
    except RuntimeError as error:
        # torch.save's zip writer turns a failed write (EFBIG, ENOSPC) into "[enforce fail at
        # inline_container.cc] unexpected pos"; the OSError survives as its context (torch 2.13 serialization.py).
        cause = error.__context__
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror, str(path)) from None
        raise


def _own_weights(module: torch.nn.Module, mesh: ParallelMesh) -> Dict[str, torch.Tensor]:
    """What this rank writes of the weights: its module's state dict (a pipeline stage's holds the layers it owns,
    by the whole model's names), a last stage's tied copy of the embeddings left out (the first stage writes
    them). Nothing is gathered: each stage writes its own file (:mod:`domino.checkpoint.model_shards`)."""
    state = module.state_dict()
    if mesh.pp.size == 1:
        return state
    tied = {name for name, p in module.named_parameters() if stored_name(name, p) != name}
    return {k: v for k, v in state.items() if k not in tied}


@dataclass
class Snapshot:
    """This rank's part of one checkpoint, copied off the training buffers: everything its writer needs."""

    tag: str
    tmp: Path
    """The temporary directory every rank writes into (``DIR/.tmp-iter_NNNNNNN.<writer token>``)."""
    final: Path
    iteration: int
    rng: Dict[str, Any]
    """This rank's RNG states."""
    model: Optional[Dict[str, torch.Tensor]] = None
    """This rank's weights to write (the first data x context parallel replica of each TP rank and stage)."""
    model_is_copy: bool = False
    """Whether ``model`` holds host copies of its own (an asynchronous save) or the live tensors."""
    optimizer: Optional[Dict[str, torch.Tensor]] = None
    """This rank's share of the optimizer state by name as whole slices (an optimizer holding them whole)."""
    fragments: Optional[Dict[str, optimizer_state.Fragment]] = None
    """This rank's own fragments of the optimizer state by name (ZeRO: :mod:`domino.checkpoint.fragment_io`)."""
    per_rank_optimizer: Optional[Dict[str, Any]] = None
    """Format 1's optimizer state of this rank (an optimizer without a state by name)."""
    meta: Optional[Dict[str, Any]] = None
    """``checkpoint.json`` (rank 0)."""
    tokenizer: Any = None
    """Saved into the checkpoint (rank 0)."""
    copied: Optional[Callable[[], None]] = None
    mesh: ParallelMesh = ParallelMesh.single()  # the layout it was taken on: how its slices are written
    """Waits until asynchronous device-to-host copies into the fields above have landed."""


def _paths(config: DominoConfig, iteration: int, writer: str):
    root = Path(config.checkpoint.save)
    tag = on_disk.checkpoint_tag(iteration)
    # The writer's own temporary: two runs on one root never share one, even without record locks.
    return root, tag, root / f".tmp-{tag}.{writer}", root / tag


def empty_snapshot(config: DominoConfig, iteration: int, writer: str) -> Snapshot:
    """A snapshot of ``iter_{iteration}`` by the run whose writer token is ``writer``, holding nothing yet: its
    names, for :func:`discard`."""
    _, tag, tmp, final = _paths(config, iteration, writer)
    return Snapshot(tag, tmp, final, iteration, {})


def prepare(config: DominoConfig, iteration: int, optimizer, writer: str, group=None) -> None:
    """Rank 0 creates the empty temporary directory of ``iter_{iteration}`` for the run ``writer`` (agreed)."""
    root, tag, tmp, _ = _paths(config, iteration, writer)
    by_name = optimizer_state.supports(optimizer)

    def make() -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # this run's own, of a save of this iteration that failed
            (tmp / (on_disk.OPTIMIZER_DIR if by_name else on_disk.LEGACY_OPTIMIZER_DIR)).mkdir(parents=True)
            (tmp / "rng").mkdir()

    agree(f"saving checkpoint {tag} (preparing {tmp})", make, group=group)


def take_snapshot(optimizer, config: DominoConfig, mesh: ParallelMesh, iteration: int, consumed_samples: int,
                  padded_vocab_size: int, writer: str, tokenizer=None, global_batch_size: Optional[int] = None,
                  schedule: Optional[dict] = None, to_host: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                  ) -> Snapshot:
    """This rank's part of checkpoint ``iter_{iteration}`` (collective over each data-parallel group of ``mesh``:
    an optimizer holding whole slices shares them out over the replicas; under ZeRO each rank copies its own
    fragments and nothing is collective).

    Args:
        writer: the run's writer token (its temporary directory's suffix).
        to_host: copies a tensor to host memory the training cannot change; by default the optimizer state is
            copied synchronously and the model's live tensors are taken as they are (written before the next
            step). An asynchronous save passes its own, for both.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    snapshot = empty_snapshot(config, iteration, writer)
    snapshot.mesh = mesh
    snapshot.rng = per_rank_state.rng_snapshot()
    scalars, failed = optimizer_state.Scalars(), []

    def copy(tensor, fn=to_host or optimizer_state.copy_to_cpu):
        # A copy that fails (pinned host memory exhausted) is raised once this rank has reached every collective
        # below: leaving at once would leave its peers waiting in the next parameter's gather.
        try:
            return tensor if failed else fn(tensor)
        except Exception as error:  # noqa: BLE001  (re-raised below)
            failed.append(error)
            return tensor

    if optimizer_state.holds_fragments(optimizer):  # each rank copies its own: no collective
        snapshot.fragments, scalars = optimizer_state.local_fragments(optimizer, to_host=copy)
    elif optimizer_state.supports(optimizer):
        # Each replica (data x context parallel) writes (and holds on the host) every n-th parameter's state.
        dp, dp_rank = mesh.dp_cp.size, mesh.dp_cp.rank
        snapshot.optimizer, scalars = optimizer_state.gather(optimizer, keep=lambda i: i % dp == dp_rank, to_host=copy)
    else:
        snapshot.per_rank_optimizer = state_dict.optimizer_snapshot(optimizer)
        if to_host is not None:
            snapshot.per_rank_optimizer = _map_tensors(snapshot.per_rank_optimizer, copy)
    if mesh.dp_cp.rank == 0:  # one replica of each TP rank and stage writes its weights
        model = _own_weights(optimizer.module, mesh)
        snapshot.model = model if to_host is None else {k: copy(v) for k, v in model.items()}
        snapshot.model_is_copy = to_host is not None
    if failed:
        raise failed[0]
    if rank == 0:
        snapshot.tokenizer = tokenizer
        snapshot.meta = {
            "iteration": iteration, "consumed_samples": consumed_samples,
            "tensor_model_parallel_size": mesh.tp.size, "pipeline_model_parallel_size": mesh.pp.size,
            "data_parallel_size": mesh.dp.size, "context_parallel_size": mesh.cp.size, "world_size": mesh.world_size,
            "global_batch_size": global_batch_size, on_disk.MODEL_STAGES_KEY: mesh.pp.size,
            "schedule": schedule,  # domino.train.schedule_check.record: checked on resume
            "optimizer": _optimizer_meta(snapshot, scalars),
            "padded_vocab_size": padded_vocab_size, "tokenizer": config.data.tokenizer,
            "config": config_to_dict(config),
        }
    return snapshot


def _optimizer_meta(snapshot: Snapshot, scalars: optimizer_state.Scalars) -> Dict[str, Any]:
    """``checkpoint.json``'s ``optimizer``: how the state is stored (:func:`fragment_io.fragments_tp` reads it)."""
    if snapshot.fragments is not None:
        return {"format": "by-name", "storage": fragment_io.STORAGE,
                "tensor_model_parallel_size": snapshot.mesh.tp.size, **scalars.to_json()}
    if snapshot.optimizer is not None:
        return {"format": "by-name", "storage": "slices", **scalars.to_json()}
    return {"format": "per-rank"}


def _map_tensors(value, fn):
    """``value`` (nested dicts, lists, tuples) with ``fn`` applied to every tensor in it."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def own_failure(caught: BaseException) -> Optional[BaseException]:
    """This rank's own error inside DCP's ``CheckpointException`` (raised on every rank when any rank's writes
    failed, each failed rank's exception in ``failures``: ``torch/distributed/checkpoint/api.py``); None when
    this rank's part succeeded."""
    own = caught.failures.get(dist.get_rank() if dist.is_initialized() else 0)
    return own[0] if own else None


def write_optimizer(snapshot: Snapshot, group=None) -> List[Path]:
    """Writes the optimizer state by name (collective over ``group``, the world's by default); returns this
    rank's files."""
    directory = snapshot.tmp / on_disk.OPTIMIZER_DIR
    if snapshot.fragments is not None:
        return fragment_io.save(directory, snapshot.fragments, snapshot.mesh, group)
    if snapshot.optimizer is None:
        return []
    return distributed_io.save(directory, snapshot.optimizer, snapshot.mesh, group)


def write_rest(snapshot: Snapshot, optimizer_files: List[Path]) -> None:
    """Writes this rank's other files and their manifest part (not collective)."""
    tmp, rank = snapshot.tmp, dist.get_rank() if dist.is_initialized() else 0
    written = [tmp / "rng" / f"rank_{rank:05d}.pt", *optimizer_files]
    if snapshot.model is not None:
        mesh = snapshot.mesh
        written.append(model_shards.save_model_shard(tmp, snapshot.model, mesh.tp.rank, snapshot.model_is_copy,
                                                     stage=mesh.pp.rank, stages=mesh.pp.size))
    _atomic_torch_save(snapshot.rng, written[0])
    if snapshot.per_rank_optimizer is not None:
        written.append(tmp / "optim" / f"rank_{rank:05d}.pt")
        _atomic_torch_save(snapshot.per_rank_optimizer, written[-1])
    manifest.write_part(tmp, rank, written)  # each rank digests its own files: the work is spread
    if snapshot.meta is not None:
        on_disk.write_checkpoint_meta(tmp, snapshot.meta)
        if snapshot.tokenizer is not None:
            snapshot.tokenizer.save(str(tmp / "tokenizer"))


def discard(snapshot: Snapshot, failure: AgreedFailure, config: DominoConfig) -> AgreedFailure:
    """Removes a failed save's temporary directory (rank 0) and returns the error to raise, with where a
    restart resumes."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(snapshot.tmp, ignore_errors=True)  # free the space; the next save starts clean anyway
    return AgreedFailure(f"{failure}; {resume_hint(config)}")


def commit(snapshot: Snapshot, config: DominoConfig, group=None) -> Path:
    """Seals and commits a checkpoint every rank has written (agreed; rank 0 renames it and moves ``latest``)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    fault_hooks.maybe_slow_down()
    fault_hooks.maybe_inject_fault("kill-in-save", snapshot.iteration)
    agree(f"saving checkpoint {snapshot.tag} (committing it)", lambda: _commit(
        snapshot.tmp, snapshot.final, config, snapshot.iteration) if rank == 0 else None, group=group)
    return snapshot.final


def save_checkpoint(optimizer, config: DominoConfig, mesh: ParallelMesh, iteration: int, consumed_samples: int,
                    padded_vocab_size: int, writer: str, tokenizer=None, global_batch_size: Optional[int] = None,
                    schedule: Optional[dict] = None) -> Path:
    """Writes checkpoint ``iter_{iteration:07d}`` under ``--save`` from every rank (collective).

    Three agreed phases (rank 0 prepares the temporary directory; every rank writes its files; rank 0
    commits): a write that fails on any rank (disk full, quota, I/O error) stops every rank with the same
    one-line error, before the commit, so the previous checkpoint and ``latest`` are untouched.
    :mod:`domino.checkpoint.async_save` runs the same phases with the writing in the background.

    Args:
        mesh: the run's layout; ``global_batch_size``: samples per iteration, recorded so a resume with another
            one is refused; ``schedule`` (the LR schedule and batch ramp) likewise; ``writer``: the run's writer
            token (:func:`domino.checkpoint.save_root.hold`).

    Returns: the final checkpoint directory.

    Raises:
        AgreedFailure: on every rank when any rank's part of the save failed.
    """
    snapshot = empty_snapshot(config, iteration, writer)
    tag = snapshot.tag
    try:
        prepare(config, iteration, optimizer, writer)

        def snapshot_and_write_optimizer():
            nonlocal snapshot
            snapshot = take_snapshot(optimizer, config, mesh, iteration, consumed_samples, padded_vocab_size, writer,
                                     tokenizer, global_batch_size, schedule=schedule)
            return write_optimizer(snapshot)

        optimizer_files = collective(f"saving checkpoint {tag} (optimizer state)", snapshot_and_write_optimizer)
        agree(f"saving checkpoint {tag}", lambda: write_rest(snapshot, optimizer_files))
    except AgreedFailure as failure:
        raise discard(snapshot, failure, config) from None
    return commit(snapshot, config)


def _commit(tmp: Path, final: Path, config: DominoConfig, iteration: int) -> None:
    """Seals the complete temporary checkpoint, renames it into place, moves ``latest``, then deletes (rank 0).

    Nothing is deleted before the new checkpoint is in place and ``latest`` names it: a checkpoint of the
    same iteration that already exists (a torn one that resume fell back past, or one that ``latest`` never
    reached) is first renamed aside and deleted last. A kill between those two renames leaves ``latest``
    naming a missing directory for an instant, and :func:`domino.checkpoint.discovery.find_checkpoint` then
    resumes from the newest complete checkpoint; a kill in any delete (slow on NFS) leaves the new one named.
    """
    root, tag = final.parent, final.name
    manifest.seal(tmp)  # before the rename: a checkpoint under its final name has its manifest
    for sub in ("", on_disk.OPTIMIZER_DIR, on_disk.LEGACY_OPTIMIZER_DIR, on_disk.RNG_DIR, on_disk.MODEL_DIR):
        if (tmp / sub).exists():
            fsync_directory(tmp / sub)
    trash = root / f".trash-{tag}"
    if final.exists():  # the same iteration saved again: the old one goes aside, deleted once replaced
        _remove_checkpoint(trash, iteration)
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_directory(root)
    on_disk.write_latest(root, tag)
    _prune(root, config.checkpoint.keep_last, keep=tag, iteration=iteration)
    for leftover in root.glob(".trash-iter_*"):  # this one, and those of saves killed while deleting
        _remove_checkpoint(leftover, iteration)
    logger.info("saved checkpoint %s", final)


def _remove_checkpoint(path: Path, iteration: int) -> None:
    """Deletes a replaced or pruned checkpoint directory (the fault hook cuts it short halfway)."""
    if not path.exists():
        return
    fault_hooks.maybe_inject_fault("kill-in-delete", iteration,
                                   partial=lambda: shutil.rmtree(path / on_disk.MODEL_DIR, ignore_errors=True))
    shutil.rmtree(path, ignore_errors=True)


def resume_hint(config: DominoConfig) -> str:
    """Where a restart of this run resumes, in words (the checkpoint ``latest`` in ``--save`` names)."""
    save = config.checkpoint.save
    if not save:
        return "nothing is saved (no --save): a restart begins again"
    try:
        latest = on_disk.find_latest_checkpoint(save)
    except (ValueError, OSError):
        latest = None
    if latest is None:
        return f"no checkpoint in {save} yet: a restart begins again"
    kept = config.train.inprocess_restart and config.checkpoint.async_save  # domino.checkpoint.inflight
    return (f"`latest` in {save} names {latest.name}: a restart resumes from it"
            + (" (an in-process restart: from the save in flight, if every rank wrote its part)" if kept else ""))


def _prune(root: Path, keep_last: Optional[int], keep: str, iteration: int) -> None:
    if not keep_last:
        return
    tags = [p.name for p in reversed(discovery.checkpoints_below(root, None))]  # by number, oldest first
    for tag in tags[:-keep_last]:
        if tag != keep:
            _remove_checkpoint(root / tag, iteration)
