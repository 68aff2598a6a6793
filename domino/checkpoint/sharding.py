"""Converting between per-TP-rank state dicts and the one unsharded state dict.

State dicts carry no parameter attributes, so the split dimension is derived from the parameter *name*
(:func:`partition_dim`), following the layout of :mod:`domino.model.gpt_model`. Every split is a plain
contiguous split: the fused QKV rows are ordered ``[head, q|k|v, head_dim]``, so contiguous row blocks are
whole heads with their q, k and v, and no stride is needed.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import torch

StateDict = Dict[str, torch.Tensor]

_ROW_SPLIT = re.compile(r"(^|\.)(embedding\.word_embeddings\.weight|output_layer\.weight"
                        r"|attention\.query_key_value\.(weight|bias)|mlp\.dense_h_to_4h\.(weight|bias))$")
_COLUMN_SPLIT = re.compile(r"(^|\.)(attention\.dense\.weight|mlp\.dense_4h_to_h\.weight)$")


def partition_dim(name: str) -> Optional[int]:
    """The dimension along which parameter ``name`` is split across TP ranks; None when replicated.

    Works with prefixes (``module.layers.0...``) as added by wrappers such as DeepSpeed's engine.
    """
    if _ROW_SPLIT.search(name):
        return 0
    if _COLUMN_SPLIT.search(name):
        return 1
    return None


def merge_tp_shards(shards: List[StateDict]) -> StateDict:
    """Joins the state dicts of TP ranks ``0..tp-1`` (in rank order) into the unsharded state dict.

    Raises:
        ValueError: when the shards hold different parameter names or mismatching shapes.
    """
    if not shards:
        raise ValueError("merge_tp_shards needs at least one state dict")
    names = list(shards[0].keys())
    for rank, sd in enumerate(shards[1:], start=1):
        if set(sd.keys()) != set(names):
            diff = sorted(set(sd.keys()) ^ set(names))
            raise ValueError(f"TP rank {rank}'s state dict differs from rank 0's in: {', '.join(diff[:5])}")
    full: StateDict = {}
    for name in names:
        parts = [sd[name] for sd in shards]
        dim = partition_dim(name)
        if dim is None:
            for rank, part in enumerate(parts[1:], start=1):
                if part.shape != parts[0].shape:
                    raise ValueError(f"replicated parameter {name}: rank {rank} has shape {tuple(part.shape)}, "
                                     f"rank 0 has {tuple(parts[0].shape)}")
            full[name] = parts[0].clone()
        else:
            full[name] = torch.cat(parts, dim=dim)
    return full


def shard_state_dict(full: StateDict, tp_rank: int, tp_size: int) -> StateDict:
    """TP rank ``tp_rank``'s state dict (of ``tp_size``) cut from the unsharded ``full``.

    Raises:
        ValueError: when ``tp_rank`` is out of range or a split dimension is not divisible by ``tp_size``.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"TP rank {tp_rank} is not in [0, {tp_size})")
    out: StateDict = {}
    for name, tensor in full.items():
        dim = partition_dim(name)
        if dim is None or tp_size == 1:
            out[name] = tensor.clone()
            continue
        if tensor.shape[dim] % tp_size:
            raise ValueError(f"{name}: dimension {dim} of size {tensor.shape[dim]} is not divisible by "
                             f"the tensor-model-parallel size {tp_size}")
        out[name] = tensor.chunk(tp_size, dim=dim)[tp_rank].clone()
    return out
