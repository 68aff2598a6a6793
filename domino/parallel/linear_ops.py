"""Autograd functions of the tensor-parallel linears: ``F.linear`` maths with a backward we control.

Two reasons to write the backward ourselves rather than let autograd derive it from ``F.linear``:

* **Asynchronous input-gradient reduction.** A column-parallel linear's input gradient must be summed over the
  TP ranks. :func:`linear` accepts a *slot*, a :class:`GradSlot` (the overlapped stacks' slots,
  :mod:`domino.overlap.slots`); its backward launches the reduction into the slot right after computing the input
  gradient, so it runs while the weight gradient is computed, and the slot's owner waits for it later.
* **Fewer buffers.** :func:`gelu_linear` (GeLU followed by a linear, the MLP's second half) turns the saved
  activation's buffer into the activation's gradient in place, so its backward allocates no
  ``[tokens, ffn/tp]`` tensor at all (and touches less memory).

Both are exact: every output element is the same dot product autograd would compute (summation order inside a
GEMM may differ, as between any two BLAS calls).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from domino.parallel import fp8


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` -> ``[tokens, n]`` (a view when possible)."""
    return t.reshape(-1, t.shape[-1])


class GradSlot(Protocol):
    """What a column-parallel linear's backward hands its input gradient to, instead of reducing it itself.

    Declared here, beside the linears that call it (:func:`linear`, and the QKV and SwiGLU projections of
    :mod:`domino.model.qkv_projection`); implemented by the overlapped stacks' slots (:mod:`domino.overlap.slots`).
    """

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """What the linear saves of its input ``x`` for the weight gradient: ``x``, or less that :meth:`restore`
        turns back into ``x`` (sequence parallelism keeps this rank's slice of the gathered sequence)."""

    def restore(self, kept: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Backward's access to what :meth:`keep` returned: launches what rebuilding the input takes (an
        all-gather, which then runs during the input-gradient GEMM) and returns a callable that waits and
        returns the input."""

    def launch(self, grad_input: torch.Tensor) -> None:
        """Starts the reduction of the input gradient over the TP ranks; the slot's owner waits for it."""


def saved_input(x: torch.Tensor, slot: Optional[GradSlot]) -> torch.Tensor:
    """What a column-parallel linear saves of its input ``x`` for the weight gradient (``x`` without a slot)."""
    return x if slot is None else slot.keep(x)


def full_input(saved: torch.Tensor, slot: Optional[GradSlot]) -> Callable[[], torch.Tensor]:
    """Backward's access to what :func:`saved_input` kept: call the result when the input is needed."""
    return (lambda: saved) if slot is None else slot.restore(saved)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, slot, rec):
        ctx.save_for_backward(saved_input(x, slot), weight)
        ctx.has_bias = bias is not None
        ctx.slot = slot
        ctx.fp8 = rec  # backward's GEMMs follow the forward's precision
        return fp8.forward_gemm(x, weight, bias, rec)

    @staticmethod
    def backward(ctx, grad_out):
        saved, weight = ctx.saved_tensors
        # Async launch (sequence parallelism): the input's all-gather runs during the input-gradient GEMM.
        x = full_input(saved, ctx.slot) if ctx.needs_input_grad[1] else None
        grad_input = fp8.grad_input_gemm(grad_out, weight, ctx.fp8) if ctx.needs_input_grad[0] else None
        if ctx.slot is not None and grad_input is not None:
            # Async launch: the input-gradient all-reduce runs during the weight-gradient GEMM below and
            # whatever autograd schedules next; the slot's owner waits for it before the gradient is read.
            ctx.slot.launch(grad_input)
        g2 = _rows(grad_out)
        grad_weight = fp8.grad_weight_gemm(g2, _rows(x()), ctx.fp8) if ctx.needs_input_grad[1] else None
        grad_bias = g2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           grad_slot: Optional[GradSlot] = None, rec: Optional[fp8.Recipe] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward may launch the input-gradient reduction asynchronously.

    Args:
        x: ``[..., in]`` input.
        weight: ``[out, in]``.
        bias: ``[out]`` or None.
        grad_slot: None (the caller handles the input gradient, e.g. with ``copy_to_tp_region``), or the
            :class:`GradSlot` whose ``launch(grad)`` starts the TP reduction of the input gradient.
        rec: the FP8 recipe of the GEMMs (the linear's ``fp8``), or None for high precision.
    """
    return _Linear.apply(x, weight, bias, grad_slot, rec)


class _GeLULinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre_activation, weight, bias):
        activation = F.gelu(pre_activation)
        ctx.save_for_backward(pre_activation, activation, weight)
        ctx.has_bias = bias is not None
        ctx.backward_done = False
        return F.linear(activation, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.backward_done:  # the saved activation was overwritten by the first backward
            raise RuntimeError("backward through gelu_linear (the MLP) can only run once "
                               "(retain_graph is not supported)")
        ctx.backward_done = True
        pre_activation, activation, weight = ctx.saved_tensors
        g2, act2 = _rows(grad_out), _rows(activation)
        grad_weight = g2.t().matmul(act2) if ctx.needs_input_grad[1] else None
        grad_bias = g2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, grad_bias
        # The activation is not needed any more: its buffer receives d loss / d activation, and then, in place,
        # d loss / d pre_activation (the elementwise GeLU backward reads each element before writing it).
        grad_act = torch.matmul(g2, weight, out=act2)
        torch.ops.aten.gelu_backward.grad_input(grad_act, _rows(pre_activation), grad_input=grad_act)
        return grad_act.view(pre_activation.shape), grad_weight, grad_bias


def gelu_linear(pre_activation: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(F.gelu(pre_activation), weight, bias)`` (exact erf GeLU) as one autograd node.

    Its backward reuses the saved GeLU output's buffer for both gradients it produces, so it allocates nothing
    ``[tokens, in]``-sized; the price is that backward can run only once (no ``retain_graph``), as for the
    fused output layer + cross-entropy.

    Args:
        pre_activation: ``[..., in]`` input of the GeLU (fc1's output, this rank's slice of the inner width).
        weight: ``[out, in]`` (fc2's weight, this rank's input columns).
        bias: ``[out]`` or None (a row-parallel bias belongs after the TP reduction, so only at TP=1).
    """
    return _GeLULinear.apply(pre_activation, weight, bias)
