"""The two MLPs of a transformer layer, interchangeable: GPT's GeLU MLP and LLaMA's SwiGLU MLP.

Both are ``fc2(act(fc1(x)))`` with fc1 column-parallel (each TP rank owns a slice of the inner width) and fc2
row-parallel (partial sums, all-reduced). They expose the same two pieces, so the layer's steps
(:meth:`domino.model.transformer.TransformerLayer.steps`) drive either without knowing which it is:

* ``inner(x, slot)``: fc1 (step D). Without ``slot`` the input gradient is all-reduced synchronously; with
  a slot (:class:`~domino.parallel.linear_ops.GradSlot`) the backward launches that reduction asynchronously.
* ``product(inner)``: the activation and this rank's fc2 product, as a function of the bias its GEMM may add
  (step E; the layer's reducer all-reduces it, or launches its reduction).
They have no ``forward`` of their own: the layer's steps are the one place they are run.

SwiGLU (Shazeer 2020; Megatron-LM ``--swiglu``, ``transformers``' ``LlamaMLP``): ``fc2(silu(x W_gate) * x W_up)``.
Its fc1 is one fused parameter whose rows alternate ``[ffn index, (gate, up)]``, so a contiguous split over TP
ranks gives each rank the gate and up rows of the same inner indices, whatever the TP size.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import ModelConfig
from domino.model.qkv_projection import grouped_projection
from domino.parallel.collectives import copy_to_tp_region
from domino.parallel.kernels import Kernels, island
from domino.parallel.layers import ColumnParallelLinear, Product, RowParallelLinear
from domino.parallel.linear_ops import GradSlot, linear
from domino.runtime.mesh import SINGLE, MeshGroup

class ParallelMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with exact (erf) GeLU; the inner width is split across the ranks of ``tp``."""

    def __init__(self, config: ModelConfig, output_std: float, tp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        bias = not config.disable_bias_linear
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.ffn_size, bias=bias,
                                                  init_std=config.init_method_std, tp=tp)
        self.dense_4h_to_h = RowParallelLinear(config.ffn_size, config.hidden_size, bias=bias, input_is_parallel=True,
                                               init_std=output_std, skip_bias_add=True, tp=tp)

    def inner(self, x: torch.Tensor, slot: Optional[GradSlot] = None) -> torch.Tensor:
        """fc1: ``[s, b, h]`` -> ``[s, b, f/tp]`` pre-activations."""
        fc1 = self.dense_h_to_4h
        return fc1(x) if slot is None else linear(x, fc1.weight, fc1.bias, grad_slot=slot, rec=fc1.fp8)

    def product(self, inner: torch.Tensor) -> Product:
        """``gelu(inner) W2_r^T`` (+ the bias given), un-reduced."""
        # GeLU runs inside fc2's product: its backward then needs no extra buffers.
        return self.dense_4h_to_h.product_of_gelu(inner)


class SwiGLUMLP(nn.Module):
    """``fc2(silu(x W_gate) * x W_up)``; ``dense_h_to_4h`` holds W_gate and W_up, rows alternating (split over
    ``tp``)."""

    def __init__(self, config: ModelConfig, output_std: float, tp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.kernels: Optional[Kernels] = None  # the kernel choice of SwiGLU, given by parallelize
        bias = not config.disable_bias_linear
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, 2 * config.ffn_size, bias=bias,
                                                  init_std=config.init_method_std, tp=tp)
        self.dense_4h_to_h = RowParallelLinear(config.ffn_size, config.hidden_size, bias=bias, input_is_parallel=True,
                                               init_std=output_std, skip_bias_add=True, tp=tp)

    def inner(self, x: torch.Tensor, slot: Optional[GradSlot] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """fc1: ``[s, b, h]`` -> ``(gate, up)``, each ``[s, b, f/tp]``."""
        fc1 = self.dense_h_to_4h
        if slot is None:
            x = copy_to_tp_region(x, self.tp)
        return grouped_projection(x, fc1.weight, fc1.bias, fc1.weight.shape[0] // 2, (1, 1), slot, fc1.fp8)

    def product(self, inner: Tuple[torch.Tensor, torch.Tensor]) -> Product:
        """``(silu(gate) * up) W2_r^T`` (+ the bias given), un-reduced."""
        gate, up = inner
        return self.dense_4h_to_h.product(swiglu(gate, up, self.kernels))


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor, kernels: Optional[Kernels] = None) -> torch.Tensor:
    """``silu(gate) * up``: two kernels and a saved ``silu(gate)`` eagerly; one kernel each way, saving only
    ``gate`` and ``up``, where ``kernels`` (else the device's) compile (Megatron-LM's ``fused_bias_swiglu.py``)."""
    return island(_swiglu, gate.device, kernels)(gate, up)


def build_mlp(config: ModelConfig, output_std: float, tp: MeshGroup = SINGLE) -> nn.Module:
    """The MLP ``config`` asks for (--swiglu or GeLU), split over ``tp``."""
    return (SwiGLUMLP if config.swiglu else ParallelMLP)(config, output_std, tp)
