"""A layer's computation between its collectives, compiled where a whole block cannot be.

``DOMINO_KERNELS=compiled`` compiles each transformer block whole where the block holds no collective (TP=1 and
CP=1, the synchronous stack: :func:`domino.model.stack.run_layers`). Elsewhere (TP > 1, CP > 1 and the overlapped
stacks, whose steps run a layer's parts around asynchronous launches and waits) it compiles the two pieces of
:meth:`~domino.model.transformer.TransformerLayer.steps` that lie between collectives and hold more than one op:

* **attention** (step A after the QKV projection): RoPE and attention, this rank's ``[s, b, heads/tp, d]``
  queries, keys and values -> its ``[s, b, h/tp]`` context;
* **MLP output** (step E): the activation (GeLU, or SwiGLU) and fc2's partial sum, which the reducer then reduces.

Every collective stays eager, where it is: the column-parallel linears (QKV, fc1), whose backward reduces their
input's gradient (Domino launches it before the weight-gradient GEMM, into the chunk's slot), run outside the
graphs, and so do the row-parallel reductions after B and E. A graph's boundaries are the collectives' own, so
Domino's overlap is the eager schedule's, and sequence parallelism's gathered inputs are handled outside the graphs
as before. The other steps are a GEMM alone (B's output projection, D's fc1) or the residual islands the device's
choice compiles already (C and F, :func:`~domino.model.transformer.bias_dropout_add_norm`).

Attention stays eager where a graph cannot hold it: a KV cache (generation), per-document attention (its documents
are read on the host), context parallelism (the ring's transfers run inside attention), selective recompute (its
checkpoint reads the generators' states). FP8 keeps step E eager (its recipes keep scaling state between steps).
Attention dropout draws from the TP stream, as eager attention does: a graph cannot swap generators, so
:func:`~domino.parallel.kernels.run_compiled` forks around the call, and the graph draws its own numbers from that
state (not eager's masks).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from domino.model.rotary import RotaryTables
from domino.parallel.document_attention import is_document_starts
from domino.parallel.kernels import Kernels, resolve, run_compiled
from domino.parallel.layers import Product


def _segment_kernels(layer: nn.Module, device: torch.device) -> Optional[Kernels]:
    """The layer's kernel choice if its steps run as compiled segments, else None."""
    kernels = resolve(layer.kernels, device)
    if kernels.compile_blocks is None or torch.compiler.is_compiling():
        return None  # while Dynamo traces a whole block, its steps are already in that graph
    return kernels


def checkpoints_attention(attention: nn.Module) -> bool:
    """Whether selective recompute replaced ``attention``'s context by a checkpointed call
    (:func:`domino.model.recompute.apply_activation_recompute`), which reads the generators' states: no graph holds
    it, so neither a whole block nor step A compiles then."""
    return "context" in vars(attention)


def draws_tp_dropout(attention: nn.Module) -> bool:
    """Whether ``attention`` draws dropout now, from the TP stream (what a compiled call around it forks to)."""
    return attention.attention_dropout > 0 and attention.training


def attention_step(step: Callable, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attend_mask: Optional[torch.Tensor], kv_cache, rotary: Optional[RotaryTables]) -> torch.Tensor:
    """``step(attention, q, k, v, attend_mask, kv_cache, rotary)``, step A's maths after the QKV projection of
    ``layer`` (a ``TransformerLayer``), compiled as one segment where it can be (see the module docstring).

    Args:
        step: the maths (a module-level function: one compiled graph serves every layer).
        q, k, v: :meth:`ParallelSelfAttention.qkv`'s outputs.
        attend_mask, kv_cache, rotary: as :meth:`ParallelSelfAttention.context`.
    """
    attention = layer.attention
    kernels = _segment_kernels(layer, q.device)
    if (kernels is None or kv_cache is not None or is_document_starts(attend_mask) or attention.cp.size > 1
            or checkpoints_attention(attention)):
        return step(attention, q, k, v, attend_mask, kv_cache, rotary)
    return run_compiled(step, kernels, attention, q, k, v, attend_mask, None, rotary,
                        tp_dropout=draws_tp_dropout(attention))


def mlp_output_step(step: Callable, layer: nn.Module, inner) -> Product:
    """``step(mlp, inner, bias)`` as a function of the bias, step E's maths of ``layer``, compiled as one segment
    where it can be.

    Args:
        step: the maths (a module-level function: one compiled graph serves every layer).
        inner: fc1's output (``(gate, up)`` for SwiGLU).
    """
    mlp = layer.mlp
    kernels = _segment_kernels(layer, mlp.dense_4h_to_h.weight.device)
    if kernels is None or mlp.dense_4h_to_h.fp8 is not None:
        return lambda bias: step(mlp, inner, bias)
    return lambda bias: run_compiled(step, kernels, mlp, inner, bias)
