"""Megatron sequence parallelism (``--sequence-parallel``) applied to a built ``GPTModel`` from outside.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.2.2): the
LayerNorm, dropout and residual regions, which tensor parallelism replicates, are split along the sequence
instead, so their activations shrink by the TP size. The all-reduce after each row-parallel linear becomes a
reduce-scatter (each rank keeps its sequence slice of the sum) and the input of each column-parallel linear is
all-gathered; the communicated bytes are those of the all-reduce (which is a reduce-scatter then an all-gather).

Here the residual stream is ``[s/tp, b, h]`` between the embedding (split after its all-reduce and dropout, so
the embedding dropout mask is the one plain TP draws) and the output layer (all-gathered before it). The layers
run the step program of :mod:`domino.overlap.steps` to its end, one step after the other
(:class:`SequenceParallelStack`); each all-gather is launched at its norm and waited for right before its linear,
each reduce-scatter launched at its row-parallel sum and waited for at the residual add, and in backward each
column-parallel linear's input-gradient reduce-scatter runs behind its weight-gradient GEMM. With
``--domino-chunks`` above 1 the Domino schedule runs the same steps on its chunks
(:func:`domino.overlap.schedule.apply_domino`), and the other chunks' steps run between every launch and its wait.
Hidden dropout on a slice draws from the TP stream, so each rank's slice gets its own mask.

The parameters used on a slice (both LayerNorms, the final one, and the row-parallel biases) get only their
slice's share of the gradient; a hook sums it over the TP ranks (Megatron all-reduces these "sequence parallel"
gradients after backward, ``finalize_model_grads``).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from domino.model.kv_cache import KVCache
from domino.model.rotary import RotaryTables
from domino.model.stack import LayerStack, StackOutput
from domino.model.transformer import run_to_end
from domino.overlap.steps import StepStack
from domino.parallel.collectives import MeshGroup, all_reduce_sum_


class SequenceParallelStack(StepStack):
    """The layers on this rank's sequence slice, one step after the other (no batch chunks).

    Args:
        model: the ``GPTModel`` whose layers it runs.
        fallback: the stack it replaces (plain TP): it runs generation with a KV cache.
    """

    def __init__(self, model: torch.nn.Module, fallback: LayerStack) -> None:
        super().__init__(model, fallback, sequence_parallel=True)

    def select(self, batch: int, kv_cache: Optional[KVCache]) -> LayerStack:
        """This stack without a KV cache; generation runs the plain TP path (same weights, same maths)."""
        return self if kv_cache is None else self.fallback.select(batch, kv_cache)

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor, attend_mask: Optional[torch.Tensor],
                 rotary: Optional[RotaryTables], kv_cache: Optional[KVCache] = None) -> StackOutput:
        """This rank's ``[s/tp, b, h]`` slice of the embeddings -> the final norm's output, gathered for the output
        layer (the gather's backward reduce-scatters the input gradient)."""
        return self.output(run_to_end(self.chunk_steps(lambda: hidden, attend_mask, rotary, 0)))


def _sum_over(tp: MeshGroup):
    """A parameter's gradient hook: the sum of the sequence slices' gradients over ``tp``."""
    return lambda grad: all_reduce_sum_(grad.clone(), tp)


def sequence_parallel_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The replicated parameters applied to sequence slices: norms and row-parallel biases."""
    params = []
    for layer in model.layers:
        for module in (layer.input_layernorm, layer.post_attention_layernorm):
            params += list(module.parameters())
        params += [b for b in (layer.attention.dense.bias, layer.mlp.dense_4h_to_h.bias) if b is not None]
    if getattr(model, "final_layernorm", None) is not None:
        params += list(model.final_layernorm.parameters())
    return params


def apply_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Makes ``model`` (a ``GPTModel``) run its training forward sequence-parallel; a no-op at TP=1. Returns it.

    Apply it to the model as built, before :func:`domino.overlap.schedule.apply_domino` (which then runs the
    sequence-parallel steps on its chunks).

    Raises:
        ValueError: another stack (Domino's) was applied first.
    """
    if model.tp.size == 1:
        return model
    if model.stack.fallback is not None:
        raise ValueError("apply_sequence_parallel must be applied to the model as built, before apply_domino")
    stack = SequenceParallelStack(model, model.stack)
    model.stack = stack
    sum_over_tp = _sum_over(model.tp)
    for param in sequence_parallel_parameters(model):
        param.register_hook(sum_over_tp)
    return model
