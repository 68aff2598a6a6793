"""FP8 GEMMs for the tensor-parallel linears: torchao's tensorwise float8 training recipe, on each rank's shard.

``--fp8-format`` takes Megatron-LM's names (``megatron/training/arguments.py``, ``--fp8-format``: ``e4m3`` for
every GEMM operand, ``hybrid`` for e4m3 in forward and e5m2 for the output gradients in backward, the format
Transformer Engine's ``DelayedScaling`` calls ``HYBRID``). The maths is torchao 0.18.0's tensorwise recipe
(``torchao/float8/float8_linear.py``, ``matmul_with_hp_or_float8_args``; ``Float8LinearRecipeName.TENSORWISE``):
before each of a linear's three GEMMs (output, input gradient, weight gradient) both operands are cast to
float8 with one dynamic scale per tensor, ``scale = float8_max / amax(|t|)``
(``torchao/float8/float8_utils.py``, ``amax_to_scale``), and the GEMM's result is divided by both scales
(``torch._scaled_mm`` on GPUs with FP8 tensor cores, compute capability 8.9 or later; torchao's ``emulate``
mode elsewhere: the same casts, an fp32 GEMM on the dequantised values, which is how the tests run it on CPU).

Scales per shard: each rank's weight shard, input and output gradient get their own scale, and each rank's
GEMM dequantises its product with them before any TP reduction, which runs in high precision; so no amax is
reduced over the TP group for the tensorwise recipe. torchao's TP support (``float8_tensor_parallel.py``)
computes a DTensor's amax over the mesh because its float8 all-gather ships one float8 tensor with one scale;
domino gathers in high precision, so a shard's own amax is exact for its GEMM. The amax and scale stay on the
device (no host read).

The recipe is a value held by each tensor-parallel linear (its ``fp8`` attribute), given to it when the model is
parallelized (:func:`domino.train.parallelize.parallelize`, from ``--fp8-format``; ``check_this_device`` refuses a
device that can run neither real nor emulated FP8 before any work), so two models of different numerics can live
in one process. :func:`linear` and the three GEMM helpers take it: they are the linears' GEMMs (the synchronous
ones in ``domino.parallel.layers``, Domino's in ``linear_ops``, the grouped QKV/SwiGLU projection), plain
``F.linear``/``matmul`` for no recipe. The output layer is given none: it stays in high precision, as
Megatron-LM's FP8 leaves it to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from domino.config import ConfigError

FORMATS = ("e4m3", "hybrid")


@dataclass(frozen=True)
class Recipe:
    """Which float8 dtype each GEMM operand takes, and whether the GEMMs are emulated."""

    forward_dtype: torch.dtype
    """Inputs and weights (both formats: e4m3, the larger mantissa)."""
    grad_dtype: torch.dtype
    """Output gradients in backward (``hybrid``: e5m2, the larger range)."""
    emulate: bool
    """torchao's emulation: float8 casts, fp32 GEMM (CPU, or a GPU without FP8 tensor cores in tests)."""


def _torchao():
    try:
        from torchao.float8 import float8_scaling_utils, float8_training_tensor
    except ImportError as error:
        raise ConfigError(f"--fp8-format needs torchao (pip install 'domino[fp8]', torchao 0.18.0): {error}") \
            from None
    return float8_scaling_utils, float8_training_tensor


def recipe(fmt: str, device: torch.device) -> Recipe:
    """The recipe of ``--fp8-format fmt`` on ``device``; one line (ConfigError) where neither real nor emulated
    FP8 can run."""
    if fmt not in FORMATS:
        raise ConfigError(f"--fp8-format {fmt!r}: expected one of {', '.join(FORMATS)}")
    _torchao()
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(f"--fp8-format {fmt}: {torch.cuda.get_device_name(device)} (compute capability "
                              f"{capability[0]}.{capability[1]}) has no FP8 tensor cores (needs 8.9+: Ada, Hopper, "
                              "Blackwell); train in --bf16 there")
        emulate = False
    elif device.type == "cpu":
        emulate = True
    else:
        raise ConfigError(f"--fp8-format {fmt}: no FP8 GEMM on {device.type} devices (CUDA 8.9+, or emulated on CPU)")
    grad = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    return Recipe(forward_dtype=torch.float8_e4m3fn, grad_dtype=grad, emulate=emulate)


def scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's tensorwise scale of ``t`` for ``dtype`` (a 0-d fp32 device tensor: no host read)."""
    from torchao.float8.float8_utils import tensor_to_scale

    return tensor_to_scale(t, dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype, role_name: str, rec: Recipe):
    scaling, training = _torchao()
    config = training.ScaledMMConfig(emulate=rec.emulate)
    mm_config = training.LinearMMConfig(config, config, config)
    role = getattr(training.GemmInputRole, role_name)
    return scaling.hp_tensor_and_scale_to_float8(t, scale(t, dtype), dtype, mm_config, role)


def mm(a: torch.Tensor, b: torch.Tensor, a_role: str, b_role: str, rec: Optional[Recipe]) -> torch.Tensor:
    """``a @ b`` for 2-d ``a`` and ``b``, both cast to float8 per ``rec`` (roles: INPUT, WEIGHT, GRAD_OUTPUT; a
    GRAD_OUTPUT operand takes the gradient dtype), in ``a``'s dtype; plain ``a @ b`` for ``rec`` None."""
    if rec is None:
        return a.matmul(b)
    dtype = {"GRAD_OUTPUT": rec.grad_dtype}
    a8 = _cast(a.contiguous(), dtype.get(a_role, rec.forward_dtype), a_role, rec)
    b8 = _cast(b.t().contiguous(), dtype.get(b_role, rec.forward_dtype), b_role, rec).t()
    return torch.mm(a8, b8).to(a.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def forward_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 rec: Optional[Recipe]) -> torch.Tensor:
    """A linear's output GEMM ``x W^T (+ b)`` (``F.linear`` for ``rec`` None)."""
    if rec is None:
        return F.linear(x, weight, bias)
    y = mm(_rows(x), weight.t(), "INPUT", "WEIGHT", rec).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def grad_input_gemm(grad_out: torch.Tensor, weight: torch.Tensor, rec: Optional[Recipe]) -> torch.Tensor:
    """A linear's input gradient ``dY W``."""
    if rec is None:
        return grad_out.matmul(weight)
    return mm(_rows(grad_out), weight, "GRAD_OUTPUT", "WEIGHT", rec).view(*grad_out.shape[:-1], weight.shape[1])


def grad_weight_gemm(grad_rows: torch.Tensor, input_rows: torch.Tensor, rec: Optional[Recipe]) -> torch.Tensor:
    """A linear's weight gradient ``dY^T X`` from ``[tokens, out]`` and ``[tokens, in]`` rows."""
    return mm(grad_rows.t(), input_rows, "GRAD_OUTPUT", "INPUT", rec)


class _FP8Linear(torch.autograd.Function):
    """``F.linear`` whose three GEMMs run in float8 (torchao's ``matmul_with_hp_or_float8_args`` maths)."""

    @staticmethod
    def forward(ctx, x, weight, bias, rec):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.rec = bias is not None, rec
        return forward_gemm(x, weight, bias, rec)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_input_gemm(grad_out, weight, ctx.rec) if ctx.needs_input_grad[0] else None
        grad_w = grad_weight_gemm(_rows(grad_out), _rows(x), ctx.rec) if ctx.needs_input_grad[1] else None
        grad_b = _rows(grad_out).sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           rec: Optional[Recipe] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, its GEMMs in float8 per ``rec`` (plain ``F.linear`` for None)."""
    if rec is None:
        return F.linear(x, weight, bias)
    return _FP8Linear.apply(x, weight, bias, rec)
