"""The norms and GeLU as the kernel choice runs them: torch's one-op forms, or the textbook formulas.

Both compute the same numbers; which runs is :mod:`domino.parallel.kernels`' choice (``fused_norms``):

* the device's choice takes torch's ops, one kernel forward and one backward where the device has one: LayerNorm
  (``aten::native_layer_norm``: CPU and CUDA kernels), GeLU (``aten::gelu``, erf or tanh: CPU and CUDA kernels),
  and RMSNorm (``torch.rms_norm``, which on CUDA dispatches to ``aten::_fused_rms_norm``; torch 2.13 ships that op
  with a CUDA kernel only, ``include/ATen/ops/_fused_rms_norm_cuda_dispatch.h``, and elsewhere runs its composite,
  the decomposition in ``torch/_decomp/decompositions.py``: the textbook ops again, in fp32);
* the plain choice (``DOMINO_KERNELS=plain``) writes each formula out, to read first and to test against.

The textbook forms compute in fp32 at least, as torch's kernels do for 16-bit inputs, and cast back.
``tests/model/test_model_norms.py`` checks both against each other, outputs and gradients.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from domino.parallel.kernels import Kernels, resolve


def textbook_layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                        eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (biased variance, as torch's)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    centered = wide - wide.mean(dim=-1, keepdim=True)
    out = centered * torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)


def textbook_rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (no centering, no bias)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    out = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    return out.to(x.dtype)


def textbook_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``x Phi(x)``: exact, ``x / 2 (1 + erf(x / sqrt 2))``, or with ``approximate="tanh"`` the GPT-2 form
    ``x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``."""
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def layer_norm(x: torch.Tensor, shape: Sequence[int], weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float, kernels: Optional[Kernels] = None) -> torch.Tensor:
    """LayerNorm over the last dimension (``shape``: its size) as ``kernels`` (else ``x``'s device's) run it."""
    if resolve(kernels, x.device).fused_norms:
        return F.layer_norm(x, shape, weight, bias, eps)
    return textbook_layer_norm(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, shape: Sequence[int], weight: Optional[torch.Tensor], eps: float,
             kernels: Optional[Kernels] = None) -> torch.Tensor:
    """RMSNorm over the last dimension as ``kernels`` (else ``x``'s device's) run it."""
    if resolve(kernels, x.device).fused_norms:
        return F.rms_norm(x, shape, weight, eps)
    return textbook_rms_norm(x, weight, eps)


def gelu(x: torch.Tensor, approximate: str = "none", kernels: Optional[Kernels] = None) -> torch.Tensor:
    """GeLU (``approximate``: ``"none"`` for erf, or ``"tanh"``) as ``kernels`` (else ``x``'s device's) run it."""
    if resolve(kernels, x.device).fused_norms:
        return F.gelu(x, approximate=approximate)
    return textbook_gelu(x, approximate)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) through :func:`layer_norm`."""

    kernels: Optional[Kernels] = None
    """The kernel choice given by ``parallelize`` (:func:`domino.parallel.kernels.apply_kernels`); None: the
    device's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, self.kernels)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and state dict) through :func:`rms_norm`; ``eps`` must be given."""

    kernels: Optional[Kernels] = None
    """The kernel choice given by ``parallelize``; None: the device's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, self.kernels)
