"""Rotary position embeddings (RoPE, Su et al. 2021), as Megatron-LM and Hugging Face LLaMA apply them.

Queries and keys are rotated, pair by pair, by an angle proportional to the token's position; attention scores
then depend on relative positions only. The pairs are ``(x_i, x_{i + r/2})`` of the first ``r`` dimensions of
each head (``r = head_dim x --rotary-percent``; the rest pass through): the "rotate half" layout of
Megatron-LM's default (``--rotary-interleaved`` off; ``_rotate_half`` in
``megatron/core/models/common/embeddings/rope_utils.py``, core_r0.11.0) and of ``transformers``'
``rotate_half``/``apply_rotary_pos_emb`` (``models/llama/modeling_llama.py``, 5.24.0). Because the layouts agree,
the q and k rows map to ``LlamaForCausalLM``'s as they are, with no permutation (Meta's original checkpoints pair
adjacent dimensions instead: Megatron's ``--rotary-interleaved``, not offered here).

The tables hold no parameters and are recomputed from the position ids on every forward, in fp32 (as both
references do) and then cast to the activations' dtype; there is no buffer that ``model.to(bf16)`` could round.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch

from domino.parallel.kernels import Kernels, island

#: Llama 3.x rope scaling's fixed parameters: Megatron-LM's ``RotaryEmbedding._apply_scaling`` defaults
#: (``megatron/core/models/common/embeddings/rotary_pos_embedding.py``) and every Llama 3.1/3.2 ``config.json``.
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_POSITIONS = 1.0, 4.0, 8192


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.x's rescaled frequencies: wavelengths longer than ``original / low`` are stretched ``factor``
    times, those shorter than ``original / high`` kept, and the band between blended smoothly (the formula of
    transformers' ``_compute_llama3_parameters`` in ``modeling_rope_utils.py`` and Megatron-LM's
    ``_apply_scaling``)."""
    low, high, original = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_POSITIONS
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, blended, scaled)


class RotaryTables(NamedTuple):
    """``cos`` and ``sin`` of every (position, frequency), ``[b or 1, s, rotated_dims]`` each."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def for_positions(cls, position_ids: torch.Tensor, rotated_dims: int, base: float,
                      dtype: torch.dtype, scaling_factor: Optional[float] = None) -> "RotaryTables":
        """The tables of ``[b or 1, s]`` position ids.

        Args:
            position_ids: int64 positions.
            rotated_dims: even number of rotated dimensions per head.
            base: the frequency base (--rotary-base).
            dtype: the dtype of the queries and keys they will rotate.
            scaling_factor: Llama 3.x rope scaling's factor (--use-rope-scaling), or None for plain RoPE.
        """
        exponents = torch.arange(0, rotated_dims, 2, device=position_ids.device, dtype=torch.int64).float()
        inv_freq = 1.0 / (base ** (exponents / rotated_dims))  # [r/2]
        if scaling_factor is not None:
            inv_freq = llama3_scaled(inv_freq, scaling_factor)
        angles = position_ids.float().unsqueeze(-1) * inv_freq  # [b, s, r/2]
        angles = torch.cat((angles, angles), dim=-1)  # [b, s, r]: pair i and i + r/2 share a frequency
        return cls(angles.cos().to(dtype), angles.sin().to(dtype))

    def split(self, sizes: List[int]) -> List["RotaryTables"]:
        """One table per batch chunk of ``sizes`` (Domino); tables shared by the batch are shared by every chunk."""
        if self.cos.shape[0] == 1:
            return [self] * len(sizes)
        return [RotaryTables(c, s) for c, s in zip(self.cos.split(sizes), self.sin.split(sizes))]

    def rotate(self, x: torch.Tensor, kernels: Optional[Kernels] = None) -> torch.Tensor:
        """``[b, heads, s, head_dim]`` queries or keys -> the same, the first ``rotated_dims`` of each head rotated
        (one fused kernel where ``kernels``, else the device's, compile: :func:`domino.parallel.kernels.island`)."""
        return island(_rotate, x.device, kernels)(x, self.cos, self.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    rotated, passed = x[..., :r], x[..., r:]
    x1, x2 = rotated.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    out = rotated * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if passed.shape[-1] == 0 else torch.cat((out, passed), dim=-1)
