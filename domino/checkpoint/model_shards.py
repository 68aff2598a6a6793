"""A checkpoint's weights: ``model/``, safetensors files by tensor-parallel rank and pipeline stage.

Every tensor is stored under its name in the whole (unstaged) model, each TP rank's slice in its own files::

    model/tp_rank_00.safetensors              one pipeline stage (or a checkpoint of format 2 before stages
    model/tp_rank_01.safetensors              wrote their own layers): TP rank r's whole slice
    model/tp_rank_00_pp_rank_000.safetensors  ``model_stages`` > 1 in ``checkpoint.json``: TP rank r's slice of
    model/tp_rank_00_pp_rank_001.safetensors  the layers each stage holds, written by that stage

So a save never gathers the model onto one host (each stage writes what it holds; Megatron-LM's
``mp_rank_TT_PPP`` directories are the same idea), and a reader that wants some tensors (one stage of another
pipeline layout) opens only their bytes: the files of a TP rank together are its whole slice, whatever the
pipeline split, and any TP size is cut from the slices (:mod:`domino.checkpoint.sharding`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file  # only through save_safetensors

from domino.atomic_files import commit, follow_umask, remove_quietly, temporary_name
from domino.checkpoint.on_disk import (MODEL_DIR, MODEL_STAGES_KEY, TOKENIZER_DIR, Checkpoint, CheckpointError,
                                       CheckpointLike, PathLike, checkpoint_tag, read_checkpoint_meta,
                                       write_checkpoint_meta, write_latest)

logger = logging.getLogger(__name__)

_SHARD_PATTERN = re.compile(r"^tp_rank_(\d{2,})(_pp_rank_\d{3,})?\.safetensors$")
StateDict = Dict[str, torch.Tensor]


def shard_file_name(tp_rank: int, stage: int = 0, stages: int = 1) -> str:
    """``tp_rank_00.safetensors`` for TP rank 0 of one stage; ``tp_rank_00_pp_rank_001.safetensors`` for its
    slice held by stage 1 of several."""
    stage_part = "" if stages == 1 else f"_pp_rank_{stage:03d}"
    return f"tp_rank_{tp_rank:02d}{stage_part}.safetensors"


def save_safetensors(tensors: StateDict, path: PathLike, metadata: Optional[Dict[str, str]] = None) -> None:
    """safetensors' ``save_file``, then the mode every other file of a checkpoint or export gets.

    ``save_file`` creates its file 0600 whatever the umask (it writes a ``tempfile::NamedTempFile``, always
    0600, and renames it into place: safetensors/safetensors#764, reported as #782; seen with safetensors
    0.8.0), so a serving pod running as another UID could not read the weights beside a readable config.
    """
    save_file(tensors, str(path), metadata=metadata)
    follow_umask(str(path))


def save_model_shard(ckpt_dir: PathLike, state_dict: StateDict, tp_rank: int, host_copies: bool = False,
                     stage: int = 0, stages: int = 1) -> Path:
    """Writes one TP rank's tensors (of pipeline ``stage`` of ``stages``) to their file under ``ckpt_dir/model/``
    atomically.

    Tensors are copied to CPU first (safetensors refuses tensors that share memory, e.g. tied weights), unless
    ``host_copies`` says they already are contiguous CPU copies of their own (an asynchronous save's snapshot).

    Returns:
        The path of the written file.
    """
    not_tensors = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise CheckpointError(f"state dict entries {not_tensors[:5]} are not tensors; only tensors can be saved")
    tensors = state_dict if host_copies else {k: v.detach().to("cpu", copy=True).contiguous()
                                              for k, v in state_dict.items()}
    final = Path(ckpt_dir) / MODEL_DIR / shard_file_name(tp_rank, stage, stages)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(str(final))
    try:
        save_safetensors(tensors, tmp, metadata={"format_version": "1", "tp_rank": str(tp_rank)})  # the shards' own
        commit(tmp, str(final))
    finally:
        remove_quietly(tmp)
    return final


def read_header_shapes(path: PathLike) -> Dict[str, Tuple[int, ...]]:
    """The tensor names and shapes of a safetensors file, read from its header alone (no tensor data).

    safetensors checks the header against the file's length when it opens it, so these shapes are backed by
    bytes on disk: comparing untrusted metadata with them bounds every allocation that follows.

    Raises:
        CheckpointError: when the file is not a readable safetensors file.
    """
    return _read_header(path, lambda tensor: tuple(tensor.get_shape()))


def read_header_dtypes(path: PathLike) -> Dict[str, str]:
    """The tensor names and dtypes (safetensors' names: ``F32``, ``BF16``, ``I64``, ``BOOL``...) of a safetensors
    file, from its header alone."""
    return _read_header(path, lambda tensor: tensor.get_dtype())


def _read_header(path: PathLike, read) -> Dict[str, Any]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return {key: read(handle.get_slice(key)) for key in handle.keys()}
    except Exception as error:  # safetensors raises several types for truncated or foreign files
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None


def _read_safetensors(paths: List[Path], names: Optional[Collection[str]] = None) -> StateDict:
    """The tensors of one TP rank's files (all, or those in ``names``), one state dict; a name stored twice is
    refused."""
    found: StateDict = {}
    where: Dict[str, Path] = {}
    for path in paths:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for key in handle.keys():
                    if key in where:
                        raise CheckpointError(f"{path}: tensor {key[:80]!r} is also stored in {where[key]}")
                    where[key] = path
                    if names is None or key in names:
                        found[key] = handle.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as error:  # safetensors raises several types for truncated or foreign files
            raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None
    missing = sorted(set(names or ()) - set(found))
    if missing:
        raise CheckpointError(f"{paths[0].parent}: TP rank files {', '.join(p.name for p in paths[:3])} hold no "
                              f"tensor {', '.join(missing[:3])}{' (and more)' if len(missing) > 3 else ''}")
    return found


def shard_paths(ckpt_dir: PathLike, meta: Optional[Dict[str, Any]] = None) -> List[List[Path]]:
    """The weight files of a checkpoint: for each TP rank in order, its files in stage order (checked against its
    metadata)."""
    ckpt_dir = Path(ckpt_dir)
    meta = meta if meta is not None else read_checkpoint_meta(ckpt_dir)
    tp, stages = meta["tensor_model_parallel_size"], meta.get(MODEL_STAGES_KEY, 1)
    model_dir = ckpt_dir / MODEL_DIR
    # The directory listing bounds the work: a metadata file claiming millions of files costs one listing.
    present = {name for name in (os.listdir(model_dir) if model_dir.is_dir() else ())
               if _SHARD_PATTERN.match(name)}
    wanted, missing = tp * stages, []
    for index in range(wanted):
        name = shard_file_name(index // stages, index % stages, stages)
        if name not in present:
            missing.append(str(model_dir / name))
            if len(missing) == 3:
                break
    if missing:
        more = f" (and {wanted - len(present) - len(missing)} more)" if wanted - len(present) > len(missing) else ""
        each = f" and {stages} pipeline stages' files per rank" if stages > 1 else ""
        raise CheckpointError(f"checkpoint {ckpt_dir} was saved with tensor_model_parallel_size={tp}{each} "
                              f"but lacks {', '.join(missing)}{more}")
    return [[model_dir / shard_file_name(r, s, stages) for s in range(stages)] for r in range(tp)]


def files_holding(paths: List[Path], names: Optional[Collection[str]]) -> List[Path]:
    """The files among ``paths`` whose headers hold any of ``names`` (all of them for None): what a reader of
    those tensors opens, and so verifies."""
    if names is None:
        return list(paths)
    return [path for path in paths if not set(read_header_shapes(path)).isdisjoint(names)]


def load_tp_shards(ckpt: CheckpointLike, names: Optional[Collection[str]] = None
                   ) -> Tuple[List[StateDict], Dict[str, Any]]:
    """Every TP rank's tensors of a checkpoint (as saved; all, or those in ``names``) and its metadata."""
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint.read(ckpt)
    return [_read_safetensors(files, names) for files in shard_paths(ckpt.path, ckpt.meta)], ckpt.meta


def load_full_state_dict(ckpt: CheckpointLike, names: Optional[Collection[str]] = None) -> StateDict:
    """The unsharded state dict of a checkpoint (TP slices joined; all tensors, or those in ``names``)."""
    from domino.checkpoint.sharding import merge_tp_shards

    shards, _ = load_tp_shards(ckpt, names)
    return shards[0] if len(shards) == 1 else merge_tp_shards(shards)


def load_model_shard(ckpt: CheckpointLike, tp_rank: int, tp_size: int,
                     names: Optional[Collection[str]] = None) -> StateDict:
    """TP rank ``tp_rank``'s tensors (of ``tp_size``; all, or those in ``names``), resharded if the checkpoint used
    another TP size.

    Raises:
        CheckpointError: when the checkpoint's padded vocabulary cannot be split ``tp_size`` ways, or it lacks one
            of ``names``.
    """
    if not 0 <= tp_rank < tp_size:
        raise CheckpointError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint.read(ckpt)
    if ckpt.tensor_model_parallel_size == tp_size:
        return _read_safetensors(shard_paths(ckpt.path, ckpt.meta)[tp_rank], names)
    if ckpt.meta["padded_vocab_size"] % tp_size:
        raise CheckpointError(
            f"checkpoint {ckpt}: padded vocabulary {ckpt.meta['padded_vocab_size']} cannot be split over "
            f"tensor_model_parallel_size={tp_size}")
    from domino.checkpoint.sharding import shard_state_dict

    logger.info("resharding %s from TP=%d to TP=%d", ckpt, ckpt.tensor_model_parallel_size, tp_size)
    return shard_state_dict(load_full_state_dict(ckpt, names), tp_rank, tp_size)


def write_weights_only_checkpoint(save_root: PathLike, config, full_state_dict: StateDict, padded_vocab_size: int,
                                  tokenizer=None, iteration: int = 0) -> Path:
    """Writes a TP=1 checkpoint holding only model weights, then points ``save_root/latest`` at it.

    Used by ``domino import-hf``; training warm-starts from it with ``--load DIR --finetune``.

    Args:
        save_root: the save root to write into (created if needed).
        config: the ``DominoConfig`` describing the model.
        full_state_dict: the unsharded ``GPTModel`` state dict.
        padded_vocab_size: rows of the (padded) embedding in ``full_state_dict``.
        tokenizer: a tokenizer to store under ``tokenizer/`` (its spec goes to the metadata).
        iteration: the iteration number to record.

    Returns:
        The checkpoint directory.
    """
    from domino.config import config_to_dict

    config = config.replace(tensor_model_parallel_size=1)
    ckpt_dir = Path(save_root) / checkpoint_tag(iteration)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    save_model_shard(ckpt_dir, full_state_dict, 0)
    if tokenizer is not None:
        tokenizer.save(str(ckpt_dir / TOKENIZER_DIR))
    write_checkpoint_meta(ckpt_dir, {
        "iteration": iteration, "consumed_samples": 0, "tensor_model_parallel_size": 1,
        "padded_vocab_size": padded_vocab_size, "tokenizer": config.data.tokenizer,
        "config": config_to_dict(config)})
    write_latest(save_root, checkpoint_tag(iteration))
    return ckpt_dir
