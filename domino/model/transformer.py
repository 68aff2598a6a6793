"""One pre-norm transformer layer (GPT or LLaMA), tensor-parallel inside its linear layers.

Read it as a plain GPT block::

    h = h + dropout(attention(LN1(h)))
    h = h + dropout(mlp(LN2(h)))

The LLaMA family swaps three small pieces, each chosen once, here or in :mod:`domino.model.mlp`: the norm
(LayerNorm or RMSNorm, :func:`build_norm`), the MLP (GeLU or SwiGLU, :func:`~domino.model.mlp.build_mlp`) and the
positions (learned, added to the embeddings, or rotary, applied to queries and keys inside attention:
:class:`~domino.model.rotary.RotaryTables`). Grouped-query attention only changes how many key/value heads the
fused QKV holds; without biases (``--disable-bias-linear``) every linear simply has none.

Tensor parallelism lives in the layer classes: the fused QKV (computed as separate q, k, v products on CPU by
:mod:`domino.model.qkv_projection`) and the MLP's first linear are column-parallel
(each rank computes its own heads / its slice of the inner width), the attention output projection and the
MLP's second linear are row-parallel (their partial sums are all-reduced). The pieces (``qkv``, ``context``,
``partial`` ...) are exposed so that the overlapped stacks of :mod:`domino.overlap` can run the same parameters
on their schedules.

Fused QKV layout: output rows are ordered ``[group, (q_1 .. q_n, k, v), head_dim]`` (Megatron-LM's layout; one
query per group without GQA), so a contiguous split of the rows across TP ranks hands each rank whole query groups
with their keys and values.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import ModelConfig
from domino.model.kv_cache import KVCache
from domino.model.mlp import build_mlp
from domino.model.qkv_projection import qkv_projection
from domino.model.rotary import RotaryTables
from domino.parallel.collectives import copy_to_tp_region
from domino.parallel.document_attention import document_attention, is_document_starts
from domino.parallel.kernels import compiled, kernels_for
from domino.parallel.layers import ColumnParallelLinear, RowParallelLinear
from domino.parallel.linear_ops import GradSlot
from domino.parallel.random import tp_region_rng
from domino.parallel.ring_attention import ring_attention
from domino.runtime.mesh import SINGLE, MeshGroup


def output_init_std(config: ModelConfig) -> float:
    """Megatron's scaled init for layers that write into the residual stream: ``std / sqrt(2 L)``."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


def build_norm(config: ModelConfig) -> nn.Module:
    """The layer's normalization: ``nn.LayerNorm`` or ``nn.RMSNorm`` (weight only) with --norm-epsilon."""
    norm = nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm
    return norm(config.hidden_size, eps=config.norm_epsilon)


class ParallelSelfAttention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention; each rank of ``tp`` owns ``groups / tp`` query groups,
    and over a context-parallel group ``cp`` the keys and values of the rest of the sequence come around a ring."""

    def __init__(self, config: ModelConfig, layer_number: int, tp: MeshGroup = SINGLE,
                 cp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.cp = cp
        # How attention reaches the rest of the sequence over ``cp``: the ring by default, or the all-to-all over
        # heads that :func:`domino.train.parallelize.parallelize` sets for --cp-comm-type a2a.
        self.context_parallel_attention = ring_attention
        world = tp.size
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"--hidden-size {config.hidden_size} is not divisible by "
                             f"--num-attention-heads {config.num_attention_heads}")
        if config.num_attention_heads % world:
            raise ValueError(f"--num-attention-heads {config.num_attention_heads} is not divisible by "
                             f"--tensor-model-parallel-size {world}")
        groups = config.query_groups
        if config.num_attention_heads % groups or groups % world:
            raise ValueError(f"--num-query-groups {groups} must divide --num-attention-heads "
                             f"{config.num_attention_heads} and be divisible by --tensor-model-parallel-size {world}")
        self.layer_number = layer_number
        self.heads_per_rank = config.num_attention_heads // world
        self.groups_per_rank = groups // world
        self.head_dim = config.head_dim
        self.attention_dropout = config.attention_dropout
        bias = not config.disable_bias_linear
        self.query_key_value = ColumnParallelLinear(config.hidden_size, (config.num_attention_heads + 2 * groups)
                                                    * self.head_dim, bias=bias, init_std=config.init_method_std,
                                                    tp=tp)
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, bias=bias, input_is_parallel=True,
                                       init_std=output_init_std(config), skip_bias_add=True, tp=tp)

    def qkv(self, x: torch.Tensor, slot: Optional[GradSlot] = None) -> Tuple[torch.Tensor, ...]:
        """This rank's queries ``[s, b, heads/tp, head_dim]``, keys and values ``[s, b, groups/tp, head_dim]`` from
        the fused ``query_key_value`` applied to ``[s, b, h]``.

        Without ``slot`` (synchronous TP) the input's gradient is all-reduced inside backward; the overlapped
        stacks pass the slot of their gradient guard and the reduction is launched into it
        (:mod:`domino.overlap.slots`).
        """
        layer = self.query_key_value
        if slot is None:
            x = copy_to_tp_region(x, self.tp)
        return qkv_projection(x, layer.weight, layer.bias, self.groups_per_rank, slot,
                              queries_per_group=self.heads_per_rank // self.groups_per_rank)

    def context(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attend_mask: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None,
                rotary: Optional[RotaryTables] = None) -> torch.Tensor:
        """Attention of this rank's heads: the outputs of :meth:`qkv` -> ``[s, b, h/tp]`` context.

        SDPA reads ``[b, heads, s, d]``: q, k and v are permuted views of the ``[s, b, heads, d]`` projections, not
        copies, and the context comes back as a view too (SDPA's CPU flash kernel lays its output out as its query
        is laid out, so ``[s, b, heads, d]`` memory is viewed as ``[s, b, h/tp]``; the math kernel's output is
        copied once, as it would be batch-first).

        Args:
            q, k, v: outputs of :meth:`qkv`.
            attend_mask: None for plain causal attention; int ``[b, s]`` document starts (per-document causal
                attention without an ``s x s`` mask, :mod:`domino.parallel.document_attention`); else bool
                ``[b or 1, 1, s, s_total]``, True = may attend (SDPA's convention; :meth:`GPTModel.forward` inverts
                Megatron's mask once per batch).
            kv_cache: when given, the new keys/values are appended and attention spans all cached tokens.
            rotary: the rotary tables of the new tokens' positions (--position-embedding-type rope), else None.
        """
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, heads, d] -> [b, heads, s, d], views
        if rotary is not None:  # before caching: the cache holds rotated keys, as transformers' does
            q, k = rotary.rotate(q), rotary.rotate(k)
        dropout = self.attention_dropout if self.training else 0.0
        if self.cp.size > 1:
            if kv_cache is not None:
                raise ValueError("context-parallel attention is training attention: no KV cache")
            return self.context_parallel_attention(q, k, v, self.cp, attend_mask=attend_mask, dropout=dropout).permute(
                2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        if is_document_starts(attend_mask):
            if kv_cache is not None:
                raise ValueError("per-document attention (document starts) is training attention: no KV cache")
            with tp_region_rng(dropout > 0):  # as SDPA's dropout below: the TP stream
                ctx = document_attention(q, k, v, attend_mask, dropout)
            return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            k, v = kv_cache.update(self.layer_number, k, v)
        is_causal, mask = attend_mask is None, attend_mask
        if attend_mask is None and past > 0:
            is_causal = False  # SDPA's is_causal aligns top-left; new tokens sit at the bottom-right
            mask = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(diagonal=past)
        # Heads are split across TP ranks, so their dropout masks must differ: use the TP RNG stream.
        with tp_region_rng(dropout > 0):
            # enable_gqa: key/value head j serves query heads j n .. (j + 1) n - 1, as transformers' repeat_kv.
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                                 enable_gqa=self.groups_per_rank != self.heads_per_rank)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)

    def forward(self, x: torch.Tensor, attend_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None,
                rotary: Optional[RotaryTables] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns ``(output, bias)``: the bias is added later with dropout and the residual (None at TP=1, where
        the GEMM already added it, or without biases). ``attend_mask`` as in :meth:`context` (True = may attend)."""
        return self.dense(self.context(*self.qkv(x), attend_mask, kv_cache, rotary))


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


def _bias_dropout_add_norm(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                           training: bool, weight: torch.Tensor, norm_bias: Optional[torch.Tensor], eps: float,
                           rms: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    hidden = _bias_dropout_add(x, bias, residual, p, training)
    shape = (hidden.shape[-1],)
    normed = F.rms_norm(hidden, shape, weight, eps) if rms else F.layer_norm(hidden, shape, weight, norm_bias, eps)
    return hidden, normed


def bias_dropout_add_norm(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                          training: bool, norm: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """``hidden = residual + dropout(x + bias)`` and ``norm(hidden)``: the residual stream and the next linear's
    input, as :func:`bias_dropout_add` then ``norm``.

    Eager on CPU (the same two calls, bit for bit); one compiled island on CUDA (:mod:`domino.parallel.kernels`),
    where the norm reads ``hidden`` from registers instead of from memory: one pass over the ``[s, b, h]``
    stream fewer, forward and backward, as Megatron-LM fuses the residual with the next norm in its Transformer
    Engine layers.
    """
    backend = kernels_for(x.device).compile_backend
    if backend is None:
        hidden = _bias_dropout_add(x, bias, residual, p, training)
        return hidden, norm(hidden)
    return compiled(_bias_dropout_add_norm, backend)(x, bias, residual, p, training, norm.weight,
                                                     getattr(norm, "bias", None), norm.eps,
                                                     isinstance(norm, nn.RMSNorm))


class TransformerLayer(nn.Module):
    """Pre-norm block: norm -> attention -> residual; norm -> MLP -> residual (split over ``tp``)."""

    def __init__(self, config: ModelConfig, layer_number: int, tp: MeshGroup = SINGLE,
                 cp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = build_norm(config)
        self.attention = ParallelSelfAttention(config, layer_number, tp, cp)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = build_mlp(config, output_init_std(config), tp)

    def forward(self, hidden: torch.Tensor, attend_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, rotary: Optional[RotaryTables] = None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]`` with synchronous tensor-parallel all-reduces (``attend_mask``: True = may
        attend, as in :meth:`ParallelSelfAttention.context`)."""
        out, bias = self.attention(self.input_layernorm(hidden), attend_mask, kv_cache, rotary)
        hidden, normed = bias_dropout_add_norm(out, bias, hidden, self.hidden_dropout, self.training,
                                               self.post_attention_layernorm)
        out, bias = self.mlp(normed)
        return bias_dropout_add(out, bias, hidden, self.hidden_dropout, self.training)
