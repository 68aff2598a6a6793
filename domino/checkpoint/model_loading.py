"""Building a model from a checkpoint: its untrusted metadata checked against the shards, then the model and
its tokenizer (what ``evaluate``, ``generate``, ``export-hf`` and ``report`` start from)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from domino.checkpoint.model_shards import load_model_shard, read_header_shapes, shard_paths
from domino.checkpoint.on_disk import META_FILE, TOKENIZER_DIR, Checkpoint, CheckpointError, PathLike
from domino.config import ConfigError
from domino.runtime.mesh import SINGLE, MeshGroup

_LAYER_PATTERN = re.compile(r"^layers\.(\d+)\.")
_EMBEDDING = "embedding.word_embeddings.weight"


def merged_header_shapes(ckpt_dir: PathLike, meta: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """The unsharded shape of every tensor of a checkpoint, from its shard headers alone (no tensor data)."""
    from domino.checkpoint.sharding import partition_dim

    merged: Dict[str, Tuple[int, ...]] = {}
    for rank, files in enumerate(shard_paths(ckpt_dir, meta)):  # a TP rank's files: one per pipeline stage
        for name, shape in (item for path in files for item in read_header_shapes(path).items()):
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
    with torch.device("meta"):  # rank 0's slice shapes at tp_size: no process group needed to size them
        skeleton = GPTModel(config.model, vocab, tp=MeshGroup.shapes_only(tp_size))
        expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    for name in sorted(set(expected) | set(stored)):
        shape, dim = stored.get(name), partition_dim(name)
        if shape is not None and dim is not None and dim < len(shape):
            shape = shape[:dim] + (shape[dim] / tp_size,) + shape[dim + 1:]
        if expected.get(name) != shape:
            raise CheckpointError(f"{source}: its config describes {name} as {expected.get(name)} but the shards "
                                  f"hold {stored.get(name)} (at tensor_model_parallel_size={tp_size})")


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
    path: Union[PathLike, Checkpoint],
    tp: MeshGroup = SINGLE,
    *,
    parallel_output: bool = True,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    load_tokenizer: bool = True,
    tokenizer_spec: Optional[str] = None,
):
    """Builds a ``GPTModel`` in eval mode holding this rank's slice of a checkpoint, split over ``tp``.

    Args:
        path: a save root (its ``latest`` checkpoint is used), an ``iter_*`` directory, or a checkpoint already
            opened (:meth:`Checkpoint.open`; its metadata is not read again).
        tp: the tensor-parallel group to load over (``ParallelMesh.tp``; any size: the checkpoint is resharded
            if needed); one process by default.
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

    ckpt = Checkpoint.open(path)
    ckpt_dir, meta = ckpt.path, ckpt.meta
    config = config_from_dict(meta["config"]).replace(tensor_model_parallel_size=tp.size)
    check_checkpoint_fits(ckpt_dir, meta, config, tp.size)
    state_dict = load_model_shard(ckpt, tp.rank, tp.size)
    model = GPTModel(config.model, meta["padded_vocab_size"], parallel_output=parallel_output, tp=tp)
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not fit the model its config describes: {error}") from None
    model.to(device=device, dtype=dtype).eval()
    tokenizer = load_checkpoint_tokenizer(ckpt_dir, meta, tokenizer_spec) if load_tokenizer else None
    return model, {**meta, "checkpoint_dir": str(ckpt_dir)}, tokenizer


