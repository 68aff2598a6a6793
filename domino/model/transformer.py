"""One pre-LayerNorm GPT transformer layer, tensor-parallel inside its linear layers.

Read it as a plain GPT block::

    h = h + dropout(attention(LN1(h)))
    h = h + dropout(mlp(LN2(h)))

Tensor parallelism lives in the layer classes: the fused QKV (computed as separate q, k, v products on CPU by
:mod:`domino.model.qkv_projection`) and the MLP's first linear are column-parallel
(each rank computes its own heads / its slice of the inner width), the attention output projection and the
MLP's second linear are row-parallel (their partial sums are all-reduced). The pieces (``qkv``, ``context``,
``partial`` ...) are exposed so that :mod:`domino.model.domino_stack` can run the same parameters on an
overlapped schedule.

Fused QKV layout: output rows are ordered ``[head, (q, k, v), head_dim]`` (Megatron-LM's layout), so a
contiguous split of the rows across TP ranks hands each rank whole heads with their q, k and v.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import ModelConfig
from domino.model.domino_ops import GradAllReduceSlot
from domino.model.kv_cache import KVCache
from domino.model.qkv_projection import qkv_projection
from domino.parallel.collectives import copy_to_tp_region, tp_rank_and_size
from domino.parallel.kernels import compiled, kernels_for
from domino.parallel.layers import ColumnParallelLinear, RowParallelLinear
from domino.parallel.random import tp_region_rng


def output_init_std(config: ModelConfig) -> float:
    """Megatron's scaled init for layers that write into the residual stream: ``std / sqrt(2 L)``."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention; each TP rank owns ``heads / tp`` heads."""

    def __init__(self, config: ModelConfig, layer_number: int) -> None:
        super().__init__()
        _, world = tp_rank_and_size()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"--hidden-size {config.hidden_size} is not divisible by "
                             f"--num-attention-heads {config.num_attention_heads}")
        if config.num_attention_heads % world:
            raise ValueError(f"--num-attention-heads {config.num_attention_heads} is not divisible by "
                             f"--tensor-model-parallel-size {world}")
        self.layer_number = layer_number
        self.heads_per_rank = config.num_attention_heads // world
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.attention_dropout = config.attention_dropout
        self.query_key_value = ColumnParallelLinear(config.hidden_size, 3 * config.hidden_size,
                                                    init_std=config.init_method_std)
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, input_is_parallel=True,
                                       init_std=output_init_std(config), skip_bias_add=True)

    def qkv(self, x: torch.Tensor, slot: Optional[GradAllReduceSlot] = None) -> Tuple[torch.Tensor, ...]:
        """This rank's queries, keys and values, each ``[b, s, heads/tp, head_dim]``, from ``query_key_value``.

        Without ``slot`` (synchronous TP) the input's gradient is all-reduced inside backward; Domino passes
        the slot of its gradient guard and the all-reduce is launched into it (:mod:`domino.model.domino_ops`).
        """
        layer = self.query_key_value
        if slot is None:
            x = copy_to_tp_region(x)
        return qkv_projection(x, layer.weight, layer.bias, self.heads_per_rank, slot)

    def context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """Attention of this rank's heads: ``[b, s, h/tp / head_dim, head_dim]`` queries, keys, values ->
        ``[b, s, h/tp]`` context.

        Args:
            q, k, v: outputs of :meth:`qkv`.
            attention_mask: None for plain causal attention, else bool ``[b or 1, 1, s, s_total]``, True = masked.
            kv_cache: when given, the new keys/values are appended and attention spans all cached tokens.
        """
        b, s = q.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            k, v = kv_cache.update(self.layer_number, k, v)
        is_causal, mask = attention_mask is None, None
        if attention_mask is not None:
            mask = ~attention_mask  # SDPA wants True = may attend
        elif past > 0:
            is_causal = False  # SDPA's is_causal aligns top-left; new tokens sit at the bottom-right
            mask = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(diagonal=past)
        dropout = self.attention_dropout if self.training else 0.0
        # Heads are split across TP ranks, so their dropout masks must differ: use the TP RNG stream.
        with tp_region_rng(dropout > 0):
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
        return ctx.transpose(1, 2).reshape(b, s, self.heads_per_rank * self.head_dim)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns ``(output, bias)``: the bias is added later with dropout and the residual (None at TP=1, where
        the GEMM already added it)."""
        return self.dense(self.context(*self.qkv(x), attention_mask, kv_cache))


class ParallelMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with exact (erf) GeLU; the inner width is split across TP ranks."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.ffn_size,
                                                  init_std=config.init_method_std)
        self.dense_4h_to_h = RowParallelLinear(config.ffn_size, config.hidden_size, input_is_parallel=True,
                                               init_std=output_init_std(config), skip_bias_add=True)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns ``(output, bias)`` like :meth:`ParallelSelfAttention.forward`."""
        # GeLU runs inside fc2's product: its backward then needs no extra buffers.
        return self.dense_4h_to_h.forward_gelu(self.dense_h_to_4h(x))


def _bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                      training: bool) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training) if p > 0 else residual + x


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """``residual + dropout(x + bias)`` (on the replicated stream: default RNG, same mask on all TP ranks).

    Eager on CPU; one compiled kernel on CUDA (:mod:`domino.parallel.kernels`).
    """
    backend = kernels_for(x.device).compile_backend
    fn = compiled(_bias_dropout_add, backend) if backend is not None else _bias_dropout_add
    return fn(x, bias, residual, p, training)


class TransformerLayer(nn.Module):
    """Pre-LN block: LayerNorm -> attention -> residual; LayerNorm -> MLP -> residual."""

    def __init__(self, config: ModelConfig, layer_number: int) -> None:
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = ParallelSelfAttention(config, layer_number)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = ParallelMLP(config)

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """``[b, s, h] -> [b, s, h]`` with synchronous tensor-parallel all-reduces."""
        out, bias = self.attention(self.input_layernorm(hidden), attention_mask, kv_cache)
        hidden = bias_dropout_add(out, bias, hidden, self.hidden_dropout, self.training)
        out, bias = self.mlp(self.post_attention_layernorm(hidden))
        return bias_dropout_add(out, bias, hidden, self.hidden_dropout, self.training)
