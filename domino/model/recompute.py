"""Activation recompute applied to a built ``GPTModel`` from outside, with Megatron-LM's semantics.

* ``--recompute-activations`` (granularity *selective*): the attention core (``ParallelSelfAttention.context``:
  scores, softmax, attention dropout, the weighted sum of values) keeps only its q, k, v inputs and is recomputed
  in backward. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
  section 5) chose this part: it holds the ``5 a s^2 b`` term of the activations for a few percent of the FLOPs.
* ``--recompute-granularity full --recompute-method uniform|block --recompute-num-layers N``: whole layers keep
  only their input. As in Megatron's ``TransformerBlock._checkpointed_forward``
  (``megatron/core/transformer/transformer_block.py``, NVIDIA/Megatron-LM commit 767a8a81), *uniform* checkpoints
  consecutive groups of N layers (one saved input per group; the last group may be shorter) and *block*
  checkpoints each of the first N layers on its own and leaves the rest as they are.

The recomputed blocks restore every RNG state first (:mod:`domino.parallel.recompute`), so dropout masks, the TP
tracker's included, are the ones of the first run and the losses equal those without recompute. With Domino
chunks, full recompute records the RNG state before every step of the overlapped schedule, because the chunks'
dropout draws interleave (:meth:`domino.overlap.steps.StepStack.chunk_steps`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional

import torch

from domino.config.schema import TrainConfig
from domino.model.stack import Unit
from domino.parallel.recompute import checkpoint


@dataclass(frozen=True)
class RecomputePlan:
    """Which activations a run recomputes (validated by ``domino.config.validate``)."""

    granularity: str
    """selective (the attention core) or full (whole layers)."""
    method: Optional[str] = None
    """With full: uniform or block."""
    num_layers: Optional[int] = None
    """With full: layers per group (uniform) or checkpointed layers (block)."""

    @classmethod
    def from_config(cls, train: TrainConfig) -> Optional["RecomputePlan"]:
        """The plan of ``--recompute-*`` flags, or None without recompute."""
        granularity = train.recompute_granularity or ("selective" if train.recompute_activations else None)
        if granularity is None:
            return None
        return cls(granularity, train.recompute_method, train.recompute_num_layers)

    def units(self, num_layers: int) -> List[Unit]:
        """``(start, end, checkpointed)`` layer groups in order, covering every layer once."""
        if self.granularity != "full":
            return [(0, num_layers, False)]
        n = self.num_layers or 1
        if self.method == "block":
            blocks = [(i, i + 1, True) for i in range(min(n, num_layers))]
            return blocks + ([(n, num_layers, False)] if n < num_layers else [])
        return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]


def _checkpointed_core(core, q, k, v, attend_mask=None, kv_cache=None, rotary=None):
    if kv_cache is not None:  # generation: no backward, and the cache must be updated once
        return core(q, k, v, attend_mask, kv_cache, rotary)
    return checkpoint(lambda q_, k_, v_: core(q_, k_, v_, attend_mask, rotary=rotary), q, k, v)


def apply_activation_recompute(model: torch.nn.Module, plan: Optional[RecomputePlan]) -> torch.nn.Module:
    """Makes ``model`` (a ``GPTModel``) recompute activations as ``plan`` says; returns it. None: unchanged.

    Selective recompute wraps each layer's ``attention.context`` (the synchronous layers and the overlapped
    stacks' step A all call it); full recompute sets the layer groups on the model's stack and on every stack it
    falls back to (so apply it before or after :mod:`domino.overlap`'s). Parameter names, checkpoints and results
    are unchanged.
    """
    if plan is None:
        return model
    if plan.granularity == "selective":  # an instance attribute: domino.model.segments.checkpoints_attention
        for layer in model.layers:
            attention = layer.attention
            attention.context = functools.partial(_checkpointed_core, attention.context)
    else:
        units = plan.units(len(model.layers))
        stack = model.stack
        while stack is not None:
            stack.units = list(units)
            stack = stack.fallback
    return model

