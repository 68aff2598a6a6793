"""Atomic training checkpoints: model shards, ZeRO optimizer state, RNG states, position in the data.

Layout of a save root (model weights and ``checkpoint.json`` are ``domino.checkpoint.on_disk``'s format)::

    DIR/latest                         tag of the newest complete checkpoint, replaced last, atomically
    DIR/iter_0000100/checkpoint.json   iteration, consumed samples, TP size, padded vocab, resolved config
    DIR/iter_0000100/model/            one safetensors file per TP rank
    DIR/iter_0000100/optimizer/        the optimizer state by parameter name and global shape, any layout
                                       reads it (domino.checkpoint.optimizer_state, distributed_io)
    DIR/iter_0000100/rng/rank_00003.pt     this rank's RNG states
    DIR/iter_0000100/tokenizer/        the tokenizer, so the checkpoint is self-contained

(DeepSpeed's fp16 optimizer without ZeRO keeps format 1's ``optim/rank_00003.pt`` instead of ``optimizer/``:
this rank's state, read back on the same layout only.)

Every rank writes into ``DIR/.tmp-iter_0000100``; once all ranks agree that their writes succeeded, rank 0
renames it into place and only then moves ``latest``. A kill at any moment, or a failed write on any rank
(disk full), therefore leaves the previous checkpoint intact and pointed to. Nothing saved needs unpickling
to be read back: safetensors, JSON, and plain tensors and numbers for ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from domino.atomic_files import atomic_write, fsync_directory
from domino.checkpoint import distributed_io, manifest, optimizer_state, per_rank_state, on_disk
from domino.config import DominoConfig, config_to_dict
from domino.pipeline.stages import stored_name
from domino.runtime import state
from domino.runtime.agreement import AgreedFailure, agree

logger = logging.getLogger(__name__)

def collective(step: str, fn):
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
        own = caught.failures.get(dist.get_rank() if dist.is_initialized() else 0)
        result, error = None, (own[0] if own else None)
    except Exception as caught:  # noqa: BLE001  (re-raised inside the agreement, which names it per rank)
        result, error = None, caught

    def report():
        if error is not None:
            raise error
        return result

    return agree(step, report)


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


def _maybe_inject_fault(point: str, iteration: int, partial: Optional[Callable[[], None]] = None) -> None:
    """Test hook: ``DOMINO_FAULT_INJECT=POINT@N`` SIGKILLs rank 0 at ``POINT`` while saving iteration N.

    ``kill-in-save`` is after every file is written and before the commit; ``kill-in-delete`` is halfway
    through removing a replaced or pruned checkpoint (``partial`` has done the first half). The kill/resume
    tests use them to prove that a save cut short never leaves a run that cannot resume.
    """
    spec = os.environ.get("DOMINO_FAULT_INJECT", "")
    if spec == f"{point}@{iteration}" and (not dist.is_initialized() or dist.get_rank() == 0):
        if partial is not None:
            partial()
        logger.warning("fault injection: killing this process in %s at iteration %d", point, iteration)
        os.kill(os.getpid(), signal.SIGKILL)


def _maybe_slow_down() -> None:
    """Test hook: ``DOMINO_FAULT_INJECT=slow-save:SECONDS`` makes rank 0 take SECONDS longer before each commit,
    like a save to a slow volume (the SIGTERM test needs one longer than torchrun's default 30 s)."""
    spec = os.environ.get("DOMINO_FAULT_INJECT", "")
    if spec.startswith("slow-save:") and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("fault injection: this save takes %s s longer", spec.split(":", 1)[1])
        time.sleep(float(spec.split(":", 1)[1]))


def _whole_model_shard(module: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """This TP rank's slice of the whole model, by the whole model's names: the module's state dict, or with
    pipeline stages every stage's gathered onto the first stage (None on the others), the last stage's tied copy
    left out. So a checkpoint's weights are the same files whatever the pipeline size.

    Collective over the pipeline group (call it on every stage of it)."""
    group = state.get_pipeline_model_parallel_group()
    if group is None:
        return module.state_dict()  # save_model_shard copies it to the host
    shared = {name for name, p in module.named_parameters() if stored_name(name, p) != name}
    local = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items() if k not in shared}
    first = dist.get_global_rank(group, 0)
    parts = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(local, parts, dst=first, group=group)  # each stage's slice, onto the first stage's host
    return {k: v for part in parts for k, v in part.items()} if parts is not None else None


def save_checkpoint(engine, config: DominoConfig, iteration: int, consumed_samples: int,
                    padded_vocab_size: int, tokenizer=None, global_batch_size: Optional[int] = None) -> Path:
    """Writes checkpoint ``iter_{iteration:07d}`` under ``--save`` from every rank (collective).

    Three agreed phases (rank 0 prepares the temporary directory; every rank writes its files; rank 0
    commits): a write that fails on any rank (disk full, quota, I/O error) stops every rank with the same
    one-line error, before the commit, so the previous checkpoint and ``latest`` are untouched.

    Args:
        global_batch_size: samples per iteration, recorded so a resume with another one is refused.

    Returns:
        The final checkpoint directory.

    Raises:
        AgreedFailure: on every rank when any rank's part of the save failed.
    """
    root = Path(config.checkpoint.save)
    tag = on_disk.checkpoint_tag(iteration)
    tmp, final = root / f".tmp-{tag}", root / tag
    rank = dist.get_rank() if dist.is_initialized() else 0

    by_name = optimizer_state.supports(engine)

    def prepare() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a run killed mid-save
            (tmp / (on_disk.OPTIMIZER_DIR if by_name else on_disk.LEGACY_OPTIMIZER_DIR)).mkdir(parents=True)
            (tmp / "rng").mkdir()

    def write_optimizer_state():
        # Each data-parallel replica writes (and holds on the host) every DP-size-th parameter's state.
        dp, dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()
        tensors, scalars = optimizer_state.gather(engine, keep=lambda index: index % dp == dp_rank)
        return distributed_io.save(tmp / on_disk.OPTIMIZER_DIR, tensors), scalars.to_json()

    def write(optimizer_files, scalars) -> None:
        written = [tmp / "rng" / f"rank_{rank:05d}.pt", *optimizer_files]
        if state.get_data_parallel_rank() == 0:
            shard = _whole_model_shard(engine.module)
            if shard is not None:
                written.append(on_disk.save_model_shard(tmp, shard, state.get_tensor_model_parallel_rank()))
        _atomic_torch_save(per_rank_state.rng_snapshot(), written[0])
        if not by_name:
            written.append(tmp / "optim" / f"rank_{rank:05d}.pt")
            _atomic_torch_save(per_rank_state.optimizer_snapshot(engine), written[-1])
        manifest.write_part(tmp, rank, written)  # each rank digests its own files: the work is spread
        if rank == 0:
            on_disk.write_checkpoint_meta(tmp, {
                "iteration": iteration, "consumed_samples": consumed_samples,
                "tensor_model_parallel_size": state.get_tensor_model_parallel_world_size(),
                "pipeline_model_parallel_size": state.get_pipeline_model_parallel_world_size(),
                "data_parallel_size": state.get_data_parallel_world_size(),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "global_batch_size": global_batch_size,
                "optimizer": {"format": "by-name", **scalars} if by_name else {"format": "per-rank"},
                "padded_vocab_size": padded_vocab_size, "tokenizer": config.data.tokenizer,
                "config": config_to_dict(config),
            })
            if tokenizer is not None:
                tokenizer.save(str(tmp / "tokenizer"))

    try:
        agree(f"saving checkpoint {tag} (preparing {tmp})", prepare)
        optimizer_files, scalars = ([], {}) if not by_name else collective(
            f"saving checkpoint {tag} (optimizer state)", write_optimizer_state)
        agree(f"saving checkpoint {tag}", lambda: write(optimizer_files, scalars))
    except AgreedFailure as failure:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # free the space; the next save starts clean anyway
        raise AgreedFailure(f"{failure}; {resume_hint(config)}") from None
    _maybe_slow_down()
    _maybe_inject_fault("kill-in-save", iteration)
    agree(f"saving checkpoint {tag} (committing it)", lambda: _commit(tmp, final, config, iteration) if rank == 0 else None)
    return final


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
    _maybe_inject_fault("kill-in-delete", iteration, partial=lambda: shutil.rmtree(path / on_disk.MODEL_DIR,
                                                                                 ignore_errors=True))
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
    return f"`latest` in {save} names {latest.name}: a restart resumes from it"


def _prune(root: Path, keep_last: Optional[int], keep: str, iteration: int) -> None:
    if not keep_last:
        return
    tags = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_"))
    for tag in tags[:-keep_last]:
        if tag != keep:
            _remove_checkpoint(root / tag, iteration)
