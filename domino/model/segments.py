"""A layer's computation between its collectives, compiled where a whole block cannot be.

``DOMINO_KERNELS=compiled`` compiles each transformer block whole where the block holds no collective (TP=1 and
CP=1, the synchronous stack: :func:`domino.model.stack.run_layers`). Elsewhere (TP > 1, CP > 1, and the overlapped
stacks, whose steps run a layer's parts around asynchronous launches and waits) it compiles the two steps of
:meth:`~domino.model.transformer.TransformerLayer.steps` that hold more than one op:

* **attention** (step A): the QKV projection, RoPE and attention: a norm's ``[s, b, h]`` output -> this rank's
  ``[s, b, h/tp]`` context;
* **MLP output** (step E): the activation (GeLU, or SwiGLU) and fc2's partial sum, which the reducer then reduces.

Every collective stays eager, outside the graphs: the row-parallel reductions after B and E, as before, and the
attention input's gradient reduction, which QKV's backward would launch from inside the graph. That one moves to an
eager node at the segment's input: ``copy_to_tp_region`` for synchronous TP, and for the overlapped stacks
:func:`~domino.parallel.linear_ops.launch_on_backward` into their gradient slot, so it is launched after the
segment's whole backward rather than before its weight-gradient GEMM; the other chunks' backward still runs between
that launch and its wait. The other steps are a GEMM alone (B's output projection, D's fc1) or the residual islands
the device's choice compiles already (C and F, :func:`~domino.model.transformer.bias_dropout_add_norm`).

A step stays eager where a graph cannot hold it: a KV cache (generation), per-document attention (its documents are
read on the host), context parallelism (the ring's transfers run inside attention), FP8 (its recipes keep scaling
state between steps), and sequence parallelism (its column-parallel linears keep only their slice of the gathered
input: the reducer's ``compiles_segments`` says so). Compiled dropout draws other numbers than eager dropout (the
graph's own generator, seeded from the stream it runs under: attention's from the TP stream, as eager).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from domino.model.rotary import RotaryTables
from domino.parallel.collectives import copy_to_tp_region
from domino.parallel.document_attention import is_document_starts
from domino.parallel.kernels import Kernels, compiled_segment, resolve, run_compiled
from domino.parallel.layers import Product
from domino.parallel.linear_ops import GradSlot, launch_on_backward


def _segment_kernels(layer: nn.Module, reducer, device: torch.device) -> Optional[Kernels]:
    """The layer's kernel choice if its steps run as compiled segments under ``reducer``, else None."""
    kernels = resolve(layer.kernels, device)
    if kernels.compile_blocks is None or not reducer.compiles_segments or torch.compiler.is_compiling():
        return None  # while Dynamo traces a whole block, its steps are already in that graph
    return kernels


def attention_step(step: Callable, layer: nn.Module, x: torch.Tensor, slot: Optional[GradSlot],
                   attend_mask: Optional[torch.Tensor], kv_cache, rotary: Optional[RotaryTables],
                   reducer) -> torch.Tensor:
    """Step A of ``layer`` (a ``TransformerLayer``): ``step(attention, x, slot, reduce_input_grad, attend_mask,
    kv_cache, rotary)``, the layer's maths, compiled as one segment where it can be (see the module docstring).

    Args:
        step: step A's maths (a module-level function: one compiled graph serves every layer).
        x, slot: what the reducer's column input returned: the norm's output and the gradient slot its QKV
            launches the input gradient's reduction into (None: synchronous TP).
        attend_mask, kv_cache, rotary: as :meth:`ParallelSelfAttention.context`.
        reducer: the layer's reducer (``compiles_segments``).
    """
    attention = layer.attention
    kernels = _segment_kernels(layer, reducer, x.device)
    if (kernels is None or kv_cache is not None or is_document_starts(attend_mask) or attention.cp.size > 1
            or attention.query_key_value.fp8 is not None):
        return step(attention, x, slot, True, attend_mask, kv_cache, rotary)
    x = copy_to_tp_region(x, attention.tp) if slot is None else launch_on_backward(x, slot)
    return run_compiled(compiled_segment(step, kernels.compile_blocks), kernels, attention, x, None, False,
                        attend_mask, None, rotary, tp_dropout=attention.attention_dropout > 0 and attention.training)


def mlp_output_step(step: Callable, layer: nn.Module, inner, reducer) -> Product:
    """Step E's product of ``layer``: ``step(mlp, inner, bias)`` as a function of the bias, the layer's maths,
    compiled as one segment where it can be.

    Args:
        step: step E's maths (a module-level function: one compiled graph serves every layer).
        inner: fc1's output (``(gate, up)`` for SwiGLU).
        reducer: the layer's reducer (``compiles_segments``).
    """
    mlp = layer.mlp
    kernels = _segment_kernels(layer, reducer, mlp.dense_4h_to_h.weight.device)
    if kernels is None or mlp.dense_4h_to_h.fp8 is not None:
        return lambda bias: step(mlp, inner, bias)
    segment = compiled_segment(step, kernels.compile_blocks)
    return lambda bias: run_compiled(segment, kernels, mlp, inner, bias)
