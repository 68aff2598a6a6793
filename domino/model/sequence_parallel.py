"""Megatron sequence parallelism (``--sequence-parallel``) applied to a built ``GPTModel`` from outside.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.2.2): the
LayerNorm, dropout and residual regions, which tensor parallelism replicates, are split along the sequence
instead, so their activations shrink by the TP size. The all-reduce after each row-parallel linear becomes a
reduce-scatter (each rank keeps its sequence slice of the sum) and the input of each column-parallel linear is
all-gathered; the communicated bytes are those of the all-reduce (which is a reduce-scatter then an all-gather).

Here the residual stream is ``[b, s/tp, h]`` between the embedding (split after its all-reduce and dropout, so
the embedding dropout mask is the one plain TP draws) and the output layer (all-gathered before it). The layers
run on the Domino stack (``DominoLayerStack``, one chunk when ``--domino-chunks 1``), which launches each
reduce-scatter asynchronously and waits for it one step of the other chunks later, as it does the all-reduces.
Hidden dropout on a slice draws from the TP stream, so each rank's slice gets its own mask.

The parameters used on a slice (both LayerNorms, the final one, and the row-parallel biases) get only their
slice's share of the gradient; a hook sums it over the TP ranks (Megatron all-reduces these "sequence parallel"
gradients after backward, ``finalize_model_grads``).
"""

from __future__ import annotations

from typing import List

import torch

from domino.model.domino_stack import DominoLayerStack
from domino.parallel.collectives import all_reduce_sum_, tp_rank_and_size


def _sum_over_tp(grad: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum_(grad.clone())


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

    Apply it before :func:`domino.model.recompute.apply_activation_recompute` (which configures the stack).
    """
    if tp_rank_and_size()[1] == 1:
        return model
    if model.domino is None:
        model.domino = DominoLayerStack(model.layers, 1)
    model.domino.sequence_parallel = True
    model.sequence_parallel = True
    for param in sequence_parallel_parameters(model):
        param.register_hook(_sum_over_tp)
    return model
