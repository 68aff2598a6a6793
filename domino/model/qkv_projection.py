"""The attention's QKV projection: one fused parameter; on CPU computed as separate q, k and v products.

The parameter stays fused in Megatron's row order ``[head, (q, k, v), head_dim]`` (checkpoints, TP sharding
and the GPT-2 import rely on it). Which product runs is decided by :mod:`domino.parallel.kernels`:

* CPU (``split_qkv``): computing it as one ``[3 h/tp, h]`` GEMM leaves q, k and v interleaved in the output, so
  attention reads strided views and autograd has to stack their gradients and copy the stack back into the
  interleaved layout (two passes over ``[b, s, 3 h/tp]`` per layer). Here the forward regroups the (small)
  weight into ``[3, h/tp, h]``, runs three GEMMs whose outputs are dense ``[b, s, h/tp]`` tensors, and the
  backward runs the matching GEMMs on the three gradients directly; on CPU the three ``h/tp``-wide GEMMs are
  also faster than the one ``3 h/tp``-wide GEMM (MKL).
* CUDA: one GEMM over the weight as stored, q, k and v as views of its output (Megatron-LM's
  ``get_query_key_value_tensors``): no regrouped weight copy is made and kept alive for backward.

Every output is the same dot product either way. The input's gradient still has to be summed over the TP
ranks: synchronous TP passes ``x`` through ``copy_to_tp_region`` first; Domino passes a
:class:`~domino.model.domino_ops.GradAllReduceSlot` and the backward launches the all-reduce asynchronously,
as :func:`~domino.parallel.linear_ops.linear` does for the other column-parallel linears.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from domino.parallel.kernels import kernels_for
from domino.parallel.linear_ops import linear


def _group_qkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[heads * 3 * d, ...]`` rows ordered ``[head, (q, k, v), d]`` -> ``[3, heads * d, ...]`` (a copy)."""
    return t.view(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(3, -1, *t.shape[1:])


def _ungroup_qkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`_group_qkv`: ``[3, heads * d, ...]`` -> ``[heads * 3 * d, ...]``."""
    return t.view(3, heads, -1, *t.shape[2:]).transpose(0, 1).reshape(-1, *t.shape[2:])


class _QKVProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, heads, slot):
        w = _group_qkv(weight, heads)
        b = _group_qkv(bias, heads) if bias is not None else None
        x2 = x.reshape(-1, x.shape[-1])
        outs = tuple((torch.addmm(b[i], x2, w[i].t()) if b is not None else x2.mm(w[i].t()))
                     .view(*x.shape[:-1], w.shape[1]) for i in range(3))
        ctx.save_for_backward(x, w)
        ctx.heads, ctx.has_bias, ctx.slot = heads, b is not None, slot
        return outs

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        x, w = ctx.saved_tensors
        width = w.shape[1]
        x2 = x.reshape(-1, x.shape[-1])
        grads = [x2.new_zeros(x2.shape[0], width) if g is None else g.reshape(-1, width)
                 for g in (grad_q, grad_k, grad_v)]
        grad_x = grads[0].mm(w[0])
        grad_x.addmm_(grads[1], w[1]).addmm_(grads[2], w[2])
        grad_x = grad_x.view(x.shape)
        if ctx.slot is not None:
            # Async launch (Domino): the all-reduce runs during the weight-gradient GEMMs below; the slot's
            # wait node (domino_ops.wait_for_input_grad) waits for it before LayerNorm's backward reads it.
            ctx.slot.launch(grad_x)
        grad_w = x2.new_empty(w.shape)
        for i in range(3):
            torch.mm(grads[i].t(), x2, out=grad_w[i])
        grad_b = _ungroup_qkv(torch.stack([g.sum(dim=0) for g in grads]), ctx.heads) if ctx.has_bias else None
        return grad_x, _ungroup_qkv(grad_w, ctx.heads), grad_b, None, None


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], heads: int,
                   slot=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``F.linear(x, weight, bias)`` split into its q, k and v columns, each ``[..., heads, head_dim]``.

    Args:
        x: ``[..., h]`` input (already through ``copy_to_tp_region`` for synchronous TP).
        weight: ``[heads * 3 * head_dim, h]`` fused weight, rows ``[head, (q, k, v), head_dim]``.
        bias: ``[heads * 3 * head_dim]`` or None.
        heads: heads in ``weight`` (this rank's).
        slot: Domino's ``GradAllReduceSlot``: the input gradient's all-reduce is launched into it.

    Returns:
        q, k, v: dense tensors on CPU; views of one ``[..., heads, 3, head_dim]`` product on CUDA.
    """
    if weight.shape[0] % (3 * heads):
        raise ValueError(f"QKV weight rows {weight.shape[0]} are not 3 x {heads} heads x head_dim")
    if kernels_for(x.device).split_qkv:
        q, k, v = _QKVProjection.apply(x, weight, bias, heads, slot)
        return tuple(t.view(*t.shape[:-1], heads, -1) for t in (q, k, v))
    mixed = linear(x, weight, bias, grad_slot=slot)  # [..., heads * 3 * head_dim]
    return mixed.view(*mixed.shape[:-1], heads, 3, -1).unbind(-2)
