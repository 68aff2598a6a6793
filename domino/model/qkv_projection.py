"""The attention's QKV projection: one fused parameter; on CPU computed as separate q, k and v products.

The parameter stays fused in Megatron's row order ``[group, (q_1 .. q_n, k, v), head_dim]`` (one query per group
without GQA: ``[head, (q, k, v), head_dim]``), so that a contiguous split of the rows hands each TP rank whole
query groups (checkpoints, TP sharding and the Hugging Face mappings rely on it; Megatron-LM core_r0.11.0
``megatron/core/transformer/attention.py``, ``SelfAttention.get_query_key_value_tensors``). Which product runs is
decided by :mod:`domino.parallel.kernels`:

* CPU (``split_qkv``): computing it as one ``[3 h/tp, h]`` GEMM leaves q, k and v interleaved in the output, so
  attention reads strided views and autograd has to stack their gradients and copy the stack back into the
  interleaved layout (two passes over the output per layer). Here the forward regroups the (small) weight into
  its q, k and v row blocks, runs three GEMMs whose outputs are dense tensors, and the backward runs the
  matching GEMMs on the three gradients directly; on CPU the three narrower GEMMs are also faster than the one
  wide GEMM (MKL).
* CUDA: one GEMM over the weight as stored, q, k and v as views of its output (Megatron-LM's
  ``get_query_key_value_tensors``): no regrouped weight copy is made and kept alive for backward.

Every output is the same dot product either way. The input's gradient still has to be summed over the TP
ranks: synchronous TP passes ``x`` through ``copy_to_tp_region`` first; the overlapped stacks pass a
:class:`~domino.parallel.linear_ops.GradSlot` and the backward launches the reduction asynchronously, as
:func:`~domino.parallel.linear_ops.linear` does for the other column-parallel linears.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from domino.parallel import fp8
from domino.parallel.kernels import Kernels, resolve
from domino.parallel.linear_ops import GradSlot, full_input, linear, saved_input


def _split_rows(t: torch.Tensor, groups: int, widths: Tuple[int, ...]) -> Tuple[torch.Tensor, ...]:
    """Rows ``[group, part, width]`` -> one ``[groups * width_i, ...]`` tensor per part (copies).

    With ``widths = (d, d, d)`` this regroups MHA's ``[head, (q, k, v), d]`` rows; with GQA's
    ``(q_per_group * d, d, d)`` each group's query heads come first; SwiGLU's fc1 is ``(1, 1)``: gate and up rows
    alternate.
    """
    rows = t.view(groups, sum(widths), *t.shape[1:])
    return tuple(part.reshape(-1, *t.shape[1:]) for part in torch.split(rows, list(widths), dim=1))


def _join_rows(parts: Sequence[torch.Tensor], groups: int, widths: Tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`_split_rows`."""
    rest = parts[0].shape[1:]
    return torch.cat([p.view(groups, w, *rest) for p, w in zip(parts, widths)], dim=1).reshape(-1, *rest)


class _GroupedProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups, widths, slot, rec):
        w = _split_rows(weight, groups, widths)
        b = _split_rows(bias, groups, widths) if bias is not None else None
        x2 = x.reshape(-1, x.shape[-1])
        ctx.fp8 = rec  # backward's GEMMs follow the forward's precision
        if rec is None:
            outs = tuple((torch.addmm(b[i], x2, w[i].t()) if b is not None else x2.mm(w[i].t()))
                         .view(*x.shape[:-1], w[i].shape[0]) for i in range(len(w)))
        else:
            outs = tuple(fp8.forward_gemm(x2, w[i], b[i] if b is not None else None, rec)
                         .view(*x.shape[:-1], w[i].shape[0]) for i in range(len(w)))
        ctx.save_for_backward(saved_input(x, slot), *w)
        ctx.groups, ctx.widths, ctx.has_bias, ctx.slot = groups, widths, b is not None, slot
        ctx.input_shape = x.shape
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):
        saved, *w = ctx.saved_tensors
        # Async launch (sequence parallelism): the input's all-gather runs during the input-gradient GEMMs.
        x = full_input(saved, ctx.slot)
        rows = ctx.input_shape[:-1].numel()
        grads = [saved.new_zeros(rows, wi.shape[0]) if g is None else g.reshape(-1, wi.shape[0])
                 for g, wi in zip(grad_outs, w)]
        if ctx.fp8 is None:
            grad_x = grads[0].mm(w[0])
            for g, wi in zip(grads[1:], w[1:]):
                grad_x.addmm_(g, wi)
        else:
            grad_x = sum(fp8.grad_input_gemm(g, wi, ctx.fp8) for g, wi in zip(grads, w))
        grad_x = grad_x.view(ctx.input_shape)
        if ctx.slot is not None:
            # Async launch (Domino): the all-reduce runs during the weight-gradient GEMMs below; the slot's
            # wait node (overlap.slots.wait_for_input_grad) waits for it before LayerNorm's backward reads it.
            ctx.slot.launch(grad_x)
        x2 = x().reshape(-1, ctx.input_shape[-1])
        grad_w = _join_rows([fp8.grad_weight_gemm(g, x2, ctx.fp8) for g in grads], ctx.groups, ctx.widths)
        grad_b = _join_rows([g.sum(dim=0) for g in grads], ctx.groups, ctx.widths) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None


def grouped_projection(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int,
                       widths: Tuple[int, ...], slot: Optional[GradSlot] = None,
                       rec: Optional[fp8.Recipe] = None) -> Tuple[torch.Tensor, ...]:
    """``F.linear(x, weight, bias)`` whose rows are ``[group, part, width]``, returned as one dense output per part.

    Computed as one GEMM per part over a regrouped copy of the weight (the CPU choice for the QKV projection;
    SwiGLU's first MLP linear, whose gate and up rows alternate, uses it on every device).

    Args:
        x: ``[..., h]`` input (already through ``copy_to_tp_region`` for synchronous TP).
        weight: ``[groups * sum(widths), h]`` fused weight.
        bias: ``[groups * sum(widths)]`` or None.
        groups: row groups in ``weight`` (this rank's).
        widths: rows of each part within a group.
        slot: a :class:`~domino.parallel.linear_ops.GradSlot`: the input gradient's reduction is launched into it.
        rec: the FP8 recipe of the GEMMs (the linear's ``fp8``), or None for high precision.

    Returns:
        One ``[..., groups * widths[i]]`` tensor per part.
    """
    if weight.shape[0] != groups * sum(widths):
        raise ValueError(f"projection weight rows {weight.shape[0]} are not {groups} groups x {sum(widths)} rows")
    return _GroupedProjection.apply(x, weight, bias, groups, tuple(widths), slot, rec)


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int,
                   slot: Optional[GradSlot] = None, queries_per_group: int = 1, rec: Optional[fp8.Recipe] = None,
                   kernels: Optional[Kernels] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``F.linear(x, weight, bias)`` split into its q, k and v columns, per head.

    Args:
        x: ``[..., h]`` input (already through ``copy_to_tp_region`` for synchronous TP).
        weight: ``[groups * (queries_per_group + 2) * head_dim, h]`` fused weight, rows
            ``[group, (q_1 .. q_n, k, v), head_dim]`` (Megatron-LM's layout; MHA has one query per group).
        bias: matching bias or None.
        groups: key/value heads (query groups) in ``weight`` (this rank's); the attention heads without GQA.
        slot: a :class:`~domino.parallel.linear_ops.GradSlot`: the input gradient's reduction is launched into it.
        queries_per_group: query heads sharing one key/value head (1 without GQA).
        rec: the FP8 recipe of the GEMMs (the linear's ``fp8``), or None for high precision.
        kernels: the attention's kernel choice (given by ``parallelize``), or None for the device's.

    Returns:
        ``q`` ``[..., groups * queries_per_group, head_dim]``, ``k`` and ``v`` ``[..., groups, head_dim]``: dense
        tensors on CPU; on CUDA views of one product (q is copied with GQA, whose query heads are not evenly
        strided).
    """
    per_group = queries_per_group + 2
    if weight.shape[0] % (per_group * groups):
        raise ValueError(f"QKV weight rows {weight.shape[0]} are not {per_group} x {groups} groups x head_dim")
    d = weight.shape[0] // (per_group * groups)
    lead = x.shape[:-1]
    if resolve(kernels, x.device).split_qkv:
        q, k, v = grouped_projection(x, weight, bias, groups, (queries_per_group * d, d, d), slot, rec)
        return q.view(*lead, groups * queries_per_group, d), k.view(*lead, groups, d), v.view(*lead, groups, d)
    mixed = linear(x, weight, bias, grad_slot=slot, rec=rec).view(*lead, groups, per_group, d)
    # One split, not three indexings: its backward concatenates the three gradients into the product's gradient
    # (one [.., 3h] write), where each index's backward would zero-fill a [.., 3h] tensor and add its slice.
    q, k, v = torch.split(mixed, (queries_per_group, 1, 1), dim=-2)
    return q.reshape(*lead, groups * queries_per_group, d), k.squeeze(-2), v.squeeze(-2)
