"""The domino checkpoint format on disk: the save root, ``checkpoint.json`` and the model shards.

A save root ``DIR`` holds ``DIR/latest`` (a text file naming the newest checkpoint, e.g. ``iter_0000100``,
replaced last by an atomic rename) and one directory per checkpoint::

    DIR/iter_0000100/
        checkpoint.json              format version, iteration, TP size, padded vocab, tokenizer, config
        model/tp_rank_00.safetensors each tensor-parallel rank's ``model.state_dict()``
        model/tp_rank_01.safetensors ...
        tokenizer/                   optional: the tokenizer, so the checkpoint is self-contained
        optimizer/                   the optimizer state by parameter name (``domino.checkpoint.distributed_io``)
        rng/                         each rank's RNG streams (``domino.checkpoint.per_rank_state``)

Weights are stored with safetensors, so loading never unpickles anything. Every file is written to a
temporary name, fsynced and renamed, so an interrupted save never leaves a half-written file under the
final name. Loading reshards: a checkpoint saved with any TP size loads on any other TP size.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from domino.atomic_files import atomic_write_text, commit, remove_quietly, temporary_name

from domino.config import ConfigError

logger = logging.getLogger(__name__)

#: Version 2 stores the optimizer state by parameter name (``optimizer/``, any layout reads it); version 1 kept
#: each rank's optimizer state (``optim/rank_NNNNN.pt``, read on the layout that wrote it). Both are read.
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
LATEST_FILE = "latest"
META_FILE = "checkpoint.json"
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
LEGACY_OPTIMIZER_DIR = "optim"
RNG_DIR = "rng"
TOKENIZER_DIR = "tokenizer"
#: ``checkpoint.json`` holds a config and a few numbers (a few kB); anything far larger is not one.
MAX_META_BYTES = 16 << 20
REQUIRED_META_KEYS = ("format_version", "iteration", "consumed_samples", "tensor_model_parallel_size",
                      "padded_vocab_size", "tokenizer", "config")
_TAG_PATTERN = re.compile(r"^iter_\d{7,}$")
_SHARD_PATTERN = re.compile(r"^tp_rank_(\d{2,})\.safetensors$")

PathLike = Union[str, os.PathLike]


class CheckpointError(ConfigError):
    """A checkpoint path or file that cannot be used; the message names the path and what is wrong."""


def checkpoint_tag(iteration: int) -> str:
    """The directory name of the checkpoint of ``iteration``: ``iter_0000100``."""
    return f"iter_{iteration:07d}"


#: A tensor name that may become a file name: no separator, not ``.`` or ``..``, nothing hidden, at most 200
#: characters (with ``.safetensors``, within the 255 bytes of a file name on Linux file systems).
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")


def check_file_name(name: str, source: str) -> str:
    """``name`` (read from an untrusted header) when it can be a file name inside its directory.

    Raises:
        CheckpointError: naming ``source`` and the name, before anything is written.
    """
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
        raise CheckpointError(f"{source}: tensor name {str(name)[:80]!r} cannot be a file name (letters, digits, "
                              "'_', '.' and '-' only, not starting with '.', at most 200): nothing written")
    return name


def tag_iteration(name: str) -> Optional[int]:
    """The iteration of a checkpoint directory name (``iter_0000100`` -> 100); None for any other name.

    Order checkpoints by it, never by name: past 10^7 iterations the tag has eight digits and sorts before
    ``iter_9999999`` as a string.
    """
    return int(name[5:]) if _TAG_PATTERN.match(name) else None


def shard_file_name(tp_rank: int) -> str:
    """``tp_rank_00.safetensors`` for rank 0."""
    return f"tp_rank_{tp_rank:02d}.safetensors"


def write_latest(save_root: PathLike, tag: str) -> None:
    """Points ``save_root/latest`` at checkpoint ``tag`` (atomically; call after the checkpoint is complete)."""
    if not _TAG_PATTERN.match(tag):
        raise CheckpointError(f"checkpoint tag {tag!r} is not of the form iter_NNNNNNN")
    atomic_write_text(str(Path(save_root) / LATEST_FILE), tag + "\n")


def find_latest_checkpoint(save_root: PathLike) -> Optional[Path]:
    """The checkpoint ``save_root/latest`` points at, or ``None`` when the root holds no ``latest`` file.

    Raises:
        CheckpointError: when ``latest`` exists but is garbage or points at no checkpoint.
    """
    target = read_latest(save_root)
    if target is not None and not (target / META_FILE).is_file():
        raise CheckpointError(f"{Path(save_root) / LATEST_FILE} points at {target.name}, but "
                              f"{target / META_FILE} does not exist")
    return target


def read_latest(save_root: PathLike) -> Optional[Path]:
    """The directory ``save_root/latest`` names (complete or not), or ``None`` when there is no ``latest``.

    Raises:
        CheckpointError: when ``latest`` does not hold a tag like ``iter_0000100``.
    """
    latest = Path(save_root) / LATEST_FILE
    if not latest.is_file():
        return None
    tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    if not _TAG_PATTERN.match(tag):
        raise CheckpointError(f"{latest} should name a checkpoint like iter_0000100, but holds {tag[:60]!r}")
    return Path(save_root) / tag


def resolve_checkpoint_dir(path: PathLike) -> Path:
    """The checkpoint directory that ``path`` designates.

    Args:
        path: a save root holding ``latest``, or one checkpoint directory (``.../iter_0000100``).

    Raises:
        CheckpointError: when ``path`` is missing, is a file, is neither kind of directory, or its
            ``latest`` is garbage or points nowhere.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} is a file; expected a save root or an iter_* directory")
    if (p / META_FILE).is_file():
        return p
    found = find_latest_checkpoint(p)
    if found is None:
        raise CheckpointError(
            f"{p} is not a checkpoint: it has neither {META_FILE} (a checkpoint directory) "
            f"nor a '{LATEST_FILE}' file (a save root)")
    return found


def _check_meta(meta: Dict[str, Any], source: str) -> None:
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(meta).__name__}")
    missing = [k for k in REQUIRED_META_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"{source}: missing field(s) {', '.join(missing)}")
    if meta["format_version"] not in READABLE_FORMAT_VERSIONS:
        raise CheckpointError(f"{source}: format_version {meta['format_version']!r} is not supported "
                              f"(this domino reads versions {', '.join(map(str, READABLE_FORMAT_VERSIONS))})")
    for key in ("iteration", "consumed_samples", "tensor_model_parallel_size", "padded_vocab_size"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise CheckpointError(f"{source}: field {key} must be a non-negative integer, got {meta[key]!r}")
    if meta["tensor_model_parallel_size"] < 1:
        raise CheckpointError(f"{source}: tensor_model_parallel_size must be >= 1")
    if not isinstance(meta["config"], dict):
        raise CheckpointError(f"{source}: field config must be an object")


def read_checkpoint_meta(ckpt_dir: PathLike) -> Dict[str, Any]:
    """Reads and checks ``ckpt_dir/checkpoint.json``.

    Raises:
        CheckpointError: when the file is missing, is not JSON, or lacks a required field.
    """
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist (is {ckpt_dir} a checkpoint directory?)")
    if path.stat().st_size > MAX_META_BYTES:  # untrusted: bounded before it is read
        raise CheckpointError(f"{path} has {path.stat().st_size} bytes; checkpoint metadata is at most "
                              f"{MAX_META_BYTES} bytes")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    _check_meta(meta, str(path))
    return meta


def write_checkpoint_meta(ckpt_dir: PathLike, meta: Dict[str, Any]) -> None:
    """Checks ``meta`` and writes it as ``ckpt_dir/checkpoint.json`` (atomically)."""
    meta = {"format_version": FORMAT_VERSION, **meta}
    _check_meta(meta, f"checkpoint metadata for {ckpt_dir}")
    atomic_write_text(str(Path(ckpt_dir) / META_FILE), json.dumps(meta, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint directory and its ``checkpoint.json``, checked once and passed along from discovery to the
    shard readers (nothing downstream reads the file again).

    Attributes:
        path: the ``iter_*`` directory.
        meta: its checked ``checkpoint.json``.
    """

    path: Path
    meta: Dict[str, Any]

    @classmethod
    def read(cls, ckpt_dir: PathLike) -> "Checkpoint":
        """The checkpoint directory ``ckpt_dir`` (its metadata read and checked, :func:`read_checkpoint_meta`)."""
        return cls(Path(ckpt_dir), read_checkpoint_meta(ckpt_dir))

    @classmethod
    def open(cls, path: "Union[PathLike, Checkpoint]") -> "Checkpoint":
        """The checkpoint ``path`` designates: a save root (its ``latest``), an ``iter_*`` directory, or one
        already read."""
        return path if isinstance(path, Checkpoint) else cls.read(resolve_checkpoint_dir(path))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def tensor_model_parallel_size(self) -> int:
        return self.meta["tensor_model_parallel_size"]

    @property
    def optimizer_format(self) -> Optional[str]:
        """How the optimizer state is stored: ``"by-name"`` (any layout reads it), ``"per-rank"`` (format 1: the
        layout that wrote it), or ``None`` (weights only: ``import-hf`` output)."""
        recorded = self.meta.get("optimizer")
        if isinstance(recorded, dict) and recorded.get("format") in ("by-name", "per-rank"):
            return recorded["format"]
        return "per-rank" if (self.path / LEGACY_OPTIMIZER_DIR).is_dir() else None

    def __str__(self) -> str:
        return str(self.path)


CheckpointLike = Union[PathLike, Checkpoint]


def save_model_shard(ckpt_dir: PathLike, state_dict: Dict[str, torch.Tensor], tp_rank: int,
                     host_copies: bool = False) -> Path:
    """Writes one TP rank's ``model.state_dict()`` to ``ckpt_dir/model/tp_rank_NN.safetensors`` atomically.

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
    final = Path(ckpt_dir) / MODEL_DIR / shard_file_name(tp_rank)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(str(final))
    try:
        save_file(tensors, tmp, metadata={"format_version": "1", "tp_rank": str(tp_rank)})  # the shards' own
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
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as error:  # safetensors raises several types for truncated or foreign files
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None


def _read_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:  # safetensors raises several types for truncated or foreign files
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None


def shard_paths(ckpt_dir: PathLike, meta: Optional[Dict[str, Any]] = None) -> List[Path]:
    """The shard files of a checkpoint in TP-rank order, checked against its metadata."""
    ckpt_dir = Path(ckpt_dir)
    meta = meta if meta is not None else read_checkpoint_meta(ckpt_dir)
    tp = meta["tensor_model_parallel_size"]
    model_dir = ckpt_dir / MODEL_DIR
    # The directory listing bounds the work: a metadata file claiming millions of ranks costs one listing.
    present = {name for name in (os.listdir(model_dir) if model_dir.is_dir() else ())
               if _SHARD_PATTERN.match(name)}
    missing = []
    for rank in range(tp):
        if shard_file_name(rank) not in present:
            missing.append(str(model_dir / shard_file_name(rank)))
            if len(missing) == 3:
                break
    if missing:
        more = f" (and {tp - len(present) - len(missing)} more)" if tp - len(present) > len(missing) else ""
        raise CheckpointError(f"checkpoint {ckpt_dir} was saved with tensor_model_parallel_size={tp} "
                              f"but lacks {', '.join(missing)}{more}")
    return [model_dir / shard_file_name(r) for r in range(tp)]


def load_tp_shards(ckpt: CheckpointLike) -> Tuple[List[Dict[str, torch.Tensor]], Dict[str, Any]]:
    """All TP shards of a checkpoint directory (as saved) and its metadata."""
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint.read(ckpt)
    return [_read_safetensors(p) for p in shard_paths(ckpt.path, ckpt.meta)], ckpt.meta


def load_full_state_dict(ckpt: CheckpointLike) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of a checkpoint directory (TP shards merged)."""
    from domino.checkpoint.sharding import merge_tp_shards

    shards, _ = load_tp_shards(ckpt)
    return shards[0] if len(shards) == 1 else merge_tp_shards(shards)


def load_model_shard(ckpt: CheckpointLike, tp_rank: int, tp_size: int) -> Dict[str, torch.Tensor]:
    """The state dict for TP rank ``tp_rank`` of ``tp_size``, resharded if the checkpoint used another TP size.

    Raises:
        CheckpointError: when the checkpoint's padded vocabulary cannot be split ``tp_size`` ways.
    """
    if not 0 <= tp_rank < tp_size:
        raise CheckpointError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint.read(ckpt)
    if ckpt.tensor_model_parallel_size == tp_size:
        return _read_safetensors(shard_paths(ckpt.path, ckpt.meta)[tp_rank])
    if ckpt.meta["padded_vocab_size"] % tp_size:
        raise CheckpointError(
            f"checkpoint {ckpt}: padded vocabulary {ckpt.meta['padded_vocab_size']} cannot be split over "
            f"tensor_model_parallel_size={tp_size}")
    from domino.checkpoint.sharding import shard_state_dict

    logger.info("resharding %s from TP=%d to TP=%d", ckpt, ckpt.tensor_model_parallel_size, tp_size)
    return shard_state_dict(load_full_state_dict(ckpt), tp_rank, tp_size)


def write_weights_only_checkpoint(
    save_root: PathLike,
    config,
    full_state_dict: Dict[str, torch.Tensor],
    padded_vocab_size: int,
    tokenizer=None,
    iteration: int = 0,
) -> Path:
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
    import copy

    from domino.config import config_to_dict

    config = copy.deepcopy(config)
    config.parallel.tensor_model_parallel_size = 1
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
