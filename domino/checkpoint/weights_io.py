"""The model-weights part of the domino checkpoint format.

A save root ``DIR`` holds ``DIR/latest`` (a text file naming the newest checkpoint, e.g. ``iter_0000100``,
replaced last by an atomic rename) and one directory per checkpoint::

    DIR/iter_0000100/
        checkpoint.json              format version, iteration, TP size, padded vocab, tokenizer, config
        model/tp_rank_00.safetensors each tensor-parallel rank's ``model.state_dict()``
        model/tp_rank_01.safetensors ...
        tokenizer/                   optional: the tokenizer, so the checkpoint is self-contained
        optim/, rng/                 training state (owned by ``domino.train``; not read here)

Weights are stored with safetensors, so loading never unpickles anything. Every file is written to a
temporary name, fsynced and renamed, so an interrupted save never leaves a half-written file under the
final name. Loading reshards: a checkpoint saved with any TP size loads on any other TP size.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from domino.atomic_files import atomic_write_text, commit, remove_quietly, temporary_name

from domino.config import ConfigError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST_FILE = "latest"
META_FILE = "checkpoint.json"
MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"
REQUIRED_META_KEYS = ("format_version", "iteration", "consumed_samples", "tensor_model_parallel_size",
                      "padded_vocab_size", "tokenizer", "config")
_TAG_PATTERN = re.compile(r"^iter_\d{7,}$")
_SHARD_PATTERN = re.compile(r"^tp_rank_(\d{2,})\.safetensors$")
_LAYER_PATTERN = re.compile(r"^layers\.(\d+)\.")
_EMBEDDING = "embedding.word_embeddings.weight"

PathLike = Union[str, os.PathLike]


class CheckpointError(ConfigError):
    """A checkpoint path or file that cannot be used; the message names the path and what is wrong."""


def checkpoint_tag(iteration: int) -> str:
    """The directory name of the checkpoint of ``iteration``: ``iter_0000100``."""
    return f"iter_{iteration:07d}"


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
    if meta["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{source}: format_version {meta['format_version']!r} is not supported "
                              f"(this domino reads version {FORMAT_VERSION})")
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


def save_model_shard(ckpt_dir: PathLike, state_dict: Dict[str, torch.Tensor], tp_rank: int) -> Path:
    """Writes one TP rank's ``model.state_dict()`` to ``ckpt_dir/model/tp_rank_NN.safetensors`` atomically.

    Tensors are copied to CPU first (safetensors refuses tensors that share memory, e.g. tied weights).

    Returns:
        The path of the written file.
    """
    not_tensors = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise CheckpointError(f"state dict entries {not_tensors[:5]} are not tensors; only tensors can be saved")
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
    final = Path(ckpt_dir) / MODEL_DIR / shard_file_name(tp_rank)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(str(final))
    try:
        save_file(tensors, tmp, metadata={"format_version": str(FORMAT_VERSION), "tp_rank": str(tp_rank)})
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


def merged_header_shapes(ckpt_dir: PathLike, meta: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """The unsharded shape of every tensor of a checkpoint, from its shard headers alone (no tensor data)."""
    from domino.checkpoint.sharding import partition_dim

    merged: Dict[str, Tuple[int, ...]] = {}
    for rank, path in enumerate(shard_paths(ckpt_dir, meta)):
        for name, shape in read_header_shapes(path).items():
            dim = partition_dim(name)
            if name not in merged or dim is None or dim >= len(shape):
                merged.setdefault(name, shape)
            elif rank:
                merged[name] = merged[name][:dim] + (merged[name][dim] + shape[dim],) + merged[name][dim + 1:]
    return merged


def check_checkpoint_fits(ckpt_dir: PathLike, meta: Dict[str, Any], config, tp_size: int = 1) -> None:
    """Checks ``checkpoint.json`` against the shard headers before a model is built from it.

    The metadata is untrusted (a hand-edited or foreign file can claim any vocabulary, width or depth);
    the headers are backed by bytes on disk. The layer count and vocabulary are compared first, then every
    tensor shape of a skeleton model built on the meta device (no memory) at ``tp_size`` with the shapes the
    shards would be cut to.

    Raises:
        CheckpointError: naming the first field or tensor where metadata and shards disagree.
    """
    from domino.model import GPTModel
    from domino.checkpoint.sharding import partition_dim

    source = Path(ckpt_dir) / META_FILE
    stored = merged_header_shapes(ckpt_dir, meta)
    layer_ids = {int(m.group(1)) for m in map(_LAYER_PATTERN.match, stored) if m}
    stored_layers = max(layer_ids) + 1 if layer_ids else 0
    if config.model.num_layers != stored_layers:
        raise CheckpointError(f"{source}: config.model.num_layers is {config.model.num_layers} but the shards "
                              f"hold {stored_layers} layers")
    vocab = meta["padded_vocab_size"]
    rows = stored.get(_EMBEDDING, (vocab,))[0]
    if rows != vocab:
        raise CheckpointError(f"{source}: padded_vocab_size is {vocab} but the shards' {_EMBEDDING} has {rows} rows")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in GPTModel(config.model, vocab).state_dict().items()}
    for name in sorted(set(expected) | set(stored)):
        shape, dim = stored.get(name), partition_dim(name)
        if shape is not None and dim is not None and dim < len(shape):
            shape = shape[:dim] + (shape[dim] / tp_size,) + shape[dim + 1:]
        if expected.get(name) != shape:
            raise CheckpointError(f"{source}: its config describes {name} as {expected.get(name)} but the shards "
                                  f"hold {stored.get(name)} (at tensor_model_parallel_size={tp_size})")


def load_tp_shards(ckpt_dir: PathLike) -> Tuple[List[Dict[str, torch.Tensor]], Dict[str, Any]]:
    """All TP shards of a checkpoint (as saved) and its metadata."""
    meta = read_checkpoint_meta(ckpt_dir)
    return [_read_safetensors(p) for p in shard_paths(ckpt_dir, meta)], meta


def load_full_state_dict(ckpt_dir: PathLike) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of a checkpoint (TP shards merged)."""
    from domino.checkpoint.sharding import merge_tp_shards

    shards, _ = load_tp_shards(ckpt_dir)
    return shards[0] if len(shards) == 1 else merge_tp_shards(shards)


def load_model_shard(ckpt_dir: PathLike, tp_rank: int, tp_size: int) -> Dict[str, torch.Tensor]:
    """The state dict for TP rank ``tp_rank`` of ``tp_size``, resharded if the checkpoint used another TP size.

    Raises:
        CheckpointError: when the checkpoint's padded vocabulary cannot be split ``tp_size`` ways.
    """
    if not 0 <= tp_rank < tp_size:
        raise CheckpointError(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    meta = read_checkpoint_meta(ckpt_dir)
    if meta["tensor_model_parallel_size"] == tp_size:
        return _read_safetensors(shard_paths(ckpt_dir, meta)[tp_rank])
    if meta["padded_vocab_size"] % tp_size:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: padded vocabulary {meta['padded_vocab_size']} cannot be split over "
            f"tensor_model_parallel_size={tp_size}")
    from domino.checkpoint.sharding import shard_state_dict

    logger.info("resharding %s from TP=%d to TP=%d", ckpt_dir, meta["tensor_model_parallel_size"], tp_size)
    return shard_state_dict(load_full_state_dict(ckpt_dir), tp_rank, tp_size)


def load_checkpoint_tokenizer(ckpt_dir: PathLike, meta: Dict[str, Any], tokenizer_spec: Optional[str] = None):
    """The tokenizer of a checkpoint: ``tokenizer_spec`` if given, else its ``tokenizer/`` copy, else its spec."""
    from domino.data.tokenizer import build_tokenizer

    saved = Path(ckpt_dir) / TOKENIZER_DIR
    spec = tokenizer_spec or (str(saved) if saved.is_dir() else meta["tokenizer"])
    try:
        return build_tokenizer(spec)
    except ConfigError:
        raise
    except Exception as error:  # a spec recorded on another machine may not resolve here
        raise CheckpointError(f"checkpoint {ckpt_dir}: cannot build tokenizer {spec!r} ({error}); "
                              "pass the tokenizer explicitly") from None


def build_model_from_checkpoint(
    path: PathLike,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    parallel_output: bool = True,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    load_tokenizer: bool = True,
    tokenizer_spec: Optional[str] = None,
):
    """Builds a ``GPTModel`` in eval mode holding TP rank ``tp_rank``'s slice of a checkpoint.

    With ``tp_size > 1`` the TP process groups must already exist (``initialize_model_parallel``).

    Args:
        path: a save root (its ``latest`` checkpoint is used) or an ``iter_*`` directory.
        tp_rank: this process's tensor-parallel rank.
        tp_size: the tensor-parallel size to load at (any; the checkpoint is resharded if needed).
        parallel_output: keep logits vocab-parallel (False gathers the full vocabulary on every rank).
        device: where the model lives.
        dtype: parameter dtype.
        load_tokenizer: also build the checkpoint's tokenizer (``None`` is returned otherwise).
        tokenizer_spec: a tokenizer spec that overrides the checkpoint's own.

    Returns:
        ``(model, meta, tokenizer)``: the model, the checkpoint metadata (plus ``"checkpoint_dir"``),
        and the tokenizer or ``None``.
    """
    from domino.config import config_from_dict
    from domino.model import GPTModel

    ckpt_dir = resolve_checkpoint_dir(path)
    meta = read_checkpoint_meta(ckpt_dir)
    config = config_from_dict(meta["config"])
    config.parallel.tensor_model_parallel_size = tp_size
    check_checkpoint_fits(ckpt_dir, meta, config, tp_size)
    state_dict = load_model_shard(ckpt_dir, tp_rank, tp_size)
    model = GPTModel(config.model, meta["padded_vocab_size"], parallel_output=parallel_output)
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not fit the model its config describes: {error}") from None
    model.to(device=device, dtype=dtype).eval()
    tokenizer = load_checkpoint_tokenizer(ckpt_dir, meta, tokenizer_spec) if load_tokenizer else None
    return model, {**meta, "checkpoint_dir": str(ckpt_dir)}, tokenizer


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
