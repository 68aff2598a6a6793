"""Atomic training checkpoints: model shards, ZeRO optimizer state, RNG states, position in the data.

Layout of a save root (model weights and ``checkpoint.json`` are ``domino.checkpoint.weights_io``'s format)::

    DIR/latest                         tag of the newest complete checkpoint, replaced last, atomically
    DIR/iter_0000100/checkpoint.json   iteration, consumed samples, TP size, padded vocab, resolved config
    DIR/iter_0000100/model/            one safetensors file per TP rank
    DIR/iter_0000100/optim/rank_00003.pt   this rank's optimizer (ZeRO partition) state
    DIR/iter_0000100/rng/rank_00003.pt     this rank's RNG states
    DIR/iter_0000100/tokenizer/        the tokenizer, so the checkpoint is self-contained

Every rank writes into ``DIR/.tmp-iter_0000100``; once all ranks agree that their writes succeeded, rank 0
renames it into place and only then moves ``latest``. A kill at any moment, or a failed write on any rank
(disk full), therefore leaves the previous checkpoint intact and pointed to. Optimizer states are saved
as plain tensors and numbers, so :mod:`domino.checkpoint.resume` loads them with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import enum
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
from domino.checkpoint import manifest, weights_io
from domino.config import DominoConfig, config_to_dict
from domino.parallel import random as tp_random
from domino.runtime import state
from domino.runtime.agreement import AgreedFailure, agree

logger = logging.getLogger(__name__)

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


def _plain_rng_state() -> Dict[str, Any]:
    """All RNG states with numpy's array turned into a tensor (loadable with ``weights_only=True``)."""
    snapshot = dict(tp_random.get_rng_state())
    kind, keys, pos, has_gauss, cached = snapshot.pop("numpy")
    snapshot["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return snapshot


def _plain_optimizer_state(engine) -> Dict[str, Any]:
    """The optimizer's state dict reduced to tensors, numbers, strings and containers of them.

    DeepSpeed's ZeRO state holds a loss-scaler object, an enum and slice-mapping objects; keeping them
    out lets loading use ``weights_only=True`` (no arbitrary unpickling).
    """
    sd = dict(engine.optimizer.state_dict())
    scaler = sd.pop("loss_scaler", None)
    if scaler is not None:
        sd["loss_scaler_fields"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}
    sd.pop("param_slice_mappings", None)
    for key, value in list(sd.items()):
        if isinstance(value, enum.Enum):
            sd[key] = value.value
    return sd


def save_checkpoint(engine, config: DominoConfig, iteration: int, consumed_samples: int,
                    padded_vocab_size: int, tokenizer=None) -> Path:
    """Writes checkpoint ``iter_{iteration:07d}`` under ``--save`` from every rank (collective).

    Three agreed phases (rank 0 prepares the temporary directory; every rank writes its files; rank 0
    commits): a write that fails on any rank (disk full, quota, I/O error) stops every rank with the same
    one-line error, before the commit, so the previous checkpoint and ``latest`` are untouched.

    Returns:
        The final checkpoint directory.

    Raises:
        AgreedFailure: on every rank when any rank's part of the save failed.
    """
    root = Path(config.checkpoint.save)
    tag = weights_io.checkpoint_tag(iteration)
    tmp, final = root / f".tmp-{tag}", root / tag
    rank = dist.get_rank() if dist.is_initialized() else 0

    def prepare() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a run killed mid-save
            (tmp / "optim").mkdir(parents=True)
            (tmp / "rng").mkdir()

    def write() -> None:
        written = [tmp / "optim" / f"rank_{rank:05d}.pt", tmp / "rng" / f"rank_{rank:05d}.pt"]
        if state.get_data_parallel_rank() == 0:
            written.append(weights_io.save_model_shard(tmp, engine.module.state_dict(),
                                                       state.get_tensor_model_parallel_rank()))
        _atomic_torch_save(_plain_optimizer_state(engine), written[0])
        _atomic_torch_save(_plain_rng_state(), written[1])
        manifest.write_part(tmp, rank, written)  # each rank digests its own files: the work is spread
        if rank == 0:
            weights_io.write_checkpoint_meta(tmp, {
                "format_version": 1, "iteration": iteration, "consumed_samples": consumed_samples,
                "tensor_model_parallel_size": state.get_tensor_model_parallel_world_size(),
                "data_parallel_size": state.get_data_parallel_world_size(),
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "padded_vocab_size": padded_vocab_size, "tokenizer": config.data.tokenizer,
                "config": config_to_dict(config),
            })
            if tokenizer is not None:
                tokenizer.save(str(tmp / "tokenizer"))

    try:
        agree(f"saving checkpoint {tag} (preparing {tmp})", prepare)
        agree(f"saving checkpoint {tag}", write)
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
    naming a missing directory for an instant, and :func:`domino.checkpoint.resume.find_checkpoint` then
    resumes from the newest complete checkpoint; a kill in any delete (slow on NFS) leaves the new one named.
    """
    root, tag = final.parent, final.name
    manifest.seal(tmp)  # before the rename: a checkpoint under its final name has its manifest
    for sub in ("", "optim", "rng", "model"):
        if (tmp / sub).exists():
            fsync_directory(tmp / sub)
    trash = root / f".trash-{tag}"
    if final.exists():  # the same iteration saved again: the old one goes aside, deleted once replaced
        _remove_checkpoint(trash, iteration)
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_directory(root)
    weights_io.write_latest(root, tag)
    _prune(root, config.checkpoint.keep_last, keep=tag, iteration=iteration)
    for leftover in root.glob(".trash-iter_*"):  # this one, and those of saves killed while deleting
        _remove_checkpoint(leftover, iteration)
    logger.info("saved checkpoint %s", final)


def _remove_checkpoint(path: Path, iteration: int) -> None:
    """Deletes a replaced or pruned checkpoint directory (the fault hook cuts it short halfway)."""
    if not path.exists():
        return
    _maybe_inject_fault("kill-in-delete", iteration, partial=lambda: shutil.rmtree(path / weights_io.MODEL_DIR,
                                                                                 ignore_errors=True))
    shutil.rmtree(path, ignore_errors=True)


def resume_hint(config: DominoConfig) -> str:
    """Where a restart of this run resumes, in words (the checkpoint ``latest`` in ``--save`` names)."""
    save = config.checkpoint.save
    if not save:
        return "nothing is saved (no --save): a restart begins again"
    try:
        latest = weights_io.find_latest_checkpoint(save)
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
