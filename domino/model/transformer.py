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
MLP's second linear are row-parallel (their partial sums are all-reduced).

The layer's maths is written once, as a step program (:meth:`TransformerLayer.steps`: a generator that yields
between its steps) that takes a :class:`Reducer`, what places the tensor-parallel communication around the steps.
The plain forward runs it to its end with :data:`SYNCHRONOUS` (every all-reduce waited where it is issued); the
overlapped stacks of :mod:`domino.overlap` pass themselves as the reducer (launch now, wait one step later) and
interleave the steps of several batch chunks.

Fused QKV layout: output rows are ordered ``[group, (q_1 .. q_n, k, v), head_dim]`` (Megatron-LM's layout; one
query per group without GQA), so a contiguous split of the rows across TP ranks hands each rank whole query groups
with their keys and values.
"""

from __future__ import annotations

import math
from typing import Callable, Generator, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import ModelConfig
from domino.model.kv_cache import KVCache
from domino.model.mlp import build_mlp
from domino.model.qkv_projection import qkv_projection
from domino.model.rotary import RotaryTables
from domino.model.segments import attention_step, mlp_output_step
from domino.parallel.collectives import copy_to_tp_region
from domino.parallel.document_attention import document_attention, is_document_starts
from domino.parallel.kernels import Kernels, compiled, resolve
from domino.parallel.layers import ColumnParallelLinear, Product, RowParallelLinear
from domino.parallel.linear_ops import GradSlot
from domino.parallel.norms import LayerNorm, RMSNorm
from domino.parallel.random import tp_region_rng
from domino.parallel.ring_attention import ring_attention
from domino.runtime.mesh import SINGLE, MeshGroup


def output_init_std(config: ModelConfig) -> float:
    """Megatron's scaled init for layers that write into the residual stream: ``std / sqrt(2 L)``."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


def build_norm(config: ModelConfig) -> nn.Module:
    """The layer's normalization: an ``nn.LayerNorm`` or ``nn.RMSNorm`` (weight only) with --norm-epsilon, run as the
    kernel choice runs norms (:mod:`domino.parallel.norms`)."""
    norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
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
        # The kernel choice of its ops (QKV, RoPE, per-document and ring attention), given by parallelize;
        # None: the device's (domino.parallel.kernels).
        self.kernels: Optional[Kernels] = None
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
                              queries_per_group=self.heads_per_rank // self.groups_per_rank, rec=layer.fp8,
                              kernels=self.kernels)

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
            q, k = rotary.rotate(q, self.kernels), rotary.rotate(k, self.kernels)
        dropout = self.attention_dropout if self.training else 0.0
        if self.cp.size > 1:
            if kv_cache is not None:
                raise ValueError("context-parallel attention is training attention: no KV cache")
            return self.context_parallel_attention(q, k, v, self.cp, attend_mask=attend_mask, dropout=dropout,
                                                   kernels=self.kernels).permute(
                2, 0, 1, 3).reshape(s, b, self.heads_per_rank * self.head_dim)
        if is_document_starts(attend_mask):
            if kv_cache is not None:
                raise ValueError("per-document attention (document starts) is training attention: no KV cache")
            with tp_region_rng(dropout > 0):  # as SDPA's dropout below: the TP stream
                ctx = document_attention(q, k, v, attend_mask, dropout, kernels=self.kernels)
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


def _bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                      training: bool) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training) if p > 0 else residual + x


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float,
                     training: bool, kernels: Optional[Kernels] = None) -> torch.Tensor:
    """``residual + dropout(x + bias)`` (on the replicated stream: default RNG, same mask on all TP ranks).

    Eager on CPU; one compiled kernel on CUDA (``kernels``, else the device's: :mod:`domino.parallel.kernels`).
    """
    backend = resolve(kernels, x.device).compile_backend
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
                          training: bool, norm: nn.Module, kernels: Optional[Kernels] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``hidden = residual + dropout(x + bias)`` and ``norm(hidden)``: the residual stream and the next linear's
    input, as :func:`bias_dropout_add` then ``norm``.

    Eager on CPU (the same two calls, bit for bit); one compiled island on CUDA (:mod:`domino.parallel.kernels`),
    where the norm reads ``hidden`` from registers instead of from memory: one pass over the ``[s, b, h]``
    stream fewer, forward and backward, as Megatron-LM fuses the residual with the next norm in its Transformer
    Engine layers. ``kernels``: the layer's choice (else the device's).
    """
    backend = resolve(kernels, x.device).compile_backend
    if backend is None:
        hidden = _bias_dropout_add(x, bias, residual, p, training)
        return hidden, norm(hidden)
    return compiled(_bias_dropout_add_norm, backend)(x, bias, residual, p, training, norm.weight,
                                                     getattr(norm, "bias", None), norm.eps,
                                                     isinstance(norm, nn.RMSNorm))


def attention_context(attention: ParallelSelfAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attend_mask: Optional[torch.Tensor], kv_cache: Optional[KVCache],
                      rotary: Optional[RotaryTables]) -> torch.Tensor:
    """Step A's maths after the QKV projection: RoPE and attention (:meth:`ParallelSelfAttention.context`)."""
    return attention.context(q, k, v, attend_mask, kv_cache, rotary)


def mlp_output(mlp: nn.Module, inner, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Step E's maths: the activation and fc2's product of fc1's output ``inner`` (+ ``bias``, or None)."""
    return mlp.product(inner)(bias)


#: A step program: yields between steps, returns the layer's (or the chunk's) output.
Steps = Generator[None, None, torch.Tensor]


class Pending(Protocol):
    """A row-parallel sum on its way (reduced, or its reduction in flight) and what follows it."""

    def finish(self, residual: torch.Tensor, layer: "TransformerLayer") -> torch.Tensor:
        """``residual + dropout(sum + bias)``, once the sum is there."""

    def finish_norm(self, residual: torch.Tensor, layer: "TransformerLayer",
                    norm: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`finish` and ``norm`` of its result, as one island: ``(hidden, norm(hidden))``."""


class Reducer(Protocol):
    """Where a layer's tensor-parallel communication happens: the two places its steps hand over to.

    ``kind`` is ``"attention"`` or ``"mlp"``; ``site`` names the layer and chunk in the comm-wait breakdown.
    """

    def column_input(self, x: torch.Tensor, kind: str, site: Optional[str]
                     ) -> Callable[[], Tuple[torch.Tensor, Optional[GradSlot]]]:
        """A norm's output made ready for a column-parallel linear: ``ready``, called when the linear runs, returns
        ``(input, gradient slot)`` (slot None: the linear all-reduces its input gradient itself)."""

    def reduce(self, row: RowParallelLinear, product: Product, kind: str, site: Optional[str]) -> Pending:
        """The sum over ``tp`` of the row-parallel ``product`` (:meth:`RowParallelLinear.product`) of ``row``."""


class _Reduced:
    """A synchronous sum: already all-reduced, the bias left for bias-dropout-add (None at TP=1: in the GEMM)."""

    __slots__ = ("out", "bias")

    def __init__(self, out: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.out, self.bias = out, bias

    def finish(self, residual: torch.Tensor, layer: "TransformerLayer") -> torch.Tensor:
        return bias_dropout_add(self.out, self.bias, residual, layer.hidden_dropout, layer.training, layer.kernels)

    def finish_norm(self, residual: torch.Tensor, layer: "TransformerLayer",
                    norm: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
        return bias_dropout_add_norm(self.out, self.bias, residual, layer.hidden_dropout, layer.training, norm,
                                     layer.kernels)


class SynchronousReducer:
    """Plain tensor parallelism: the linears' own synchronous collectives (``copy_to_tp_region`` in the column-
    parallel ones, :meth:`RowParallelLinear.reduce`), so the row-parallel bias rides in the GEMM at TP=1."""

    def column_input(self, x: torch.Tensor, kind: str, site: Optional[str]
                     ) -> Callable[[], Tuple[torch.Tensor, None]]:
        return lambda: (x, None)

    def reduce(self, row: RowParallelLinear, product: Product, kind: str, site: Optional[str]) -> _Reduced:
        out, bias = row.reduce(product)
        return _Reduced(out, bias)


#: The reducer of the plain forward.
SYNCHRONOUS = SynchronousReducer()


def run_to_end(steps: Steps) -> torch.Tensor:
    """Runs a step program one step after the other; returns its output."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


class TransformerLayer(nn.Module):
    """Pre-norm block: norm -> attention -> residual; norm -> MLP -> residual (split over ``tp``)."""

    def __init__(self, config: ModelConfig, layer_number: int, tp: MeshGroup = SINGLE,
                 cp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.kernels: Optional[Kernels] = None  # its residual islands' kernel choice, given by parallelize
        self.input_layernorm = build_norm(config)
        self.attention = ParallelSelfAttention(config, layer_number, tp, cp)
        self.post_attention_layernorm = build_norm(config)
        self.mlp = build_mlp(config, output_init_std(config), tp)

    def forward(self, hidden: torch.Tensor, attend_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, rotary: Optional[RotaryTables] = None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]`` with synchronous tensor-parallel all-reduces (``attend_mask``: True = may
        attend, as in :meth:`ParallelSelfAttention.context`): :meth:`steps` run to their end."""
        return run_to_end(self.steps(hidden, attend_mask, rotary, SYNCHRONOUS, kv_cache=kv_cache))

    def steps(self, hidden: torch.Tensor, attend_mask: Optional[torch.Tensor], rotary: Optional[RotaryTables],
              reducer: Reducer, site: Optional[str] = None, kv_cache: Optional[KVCache] = None) -> Steps:
        """The layer's maths, once: LN1 and its column input, then six steps, yielding between them; returns the
        output. The steps are those Domino's schedule interleaves (names from the reference schedule)::

            A  QKV (column-parallel) + attention          D  fc1 (column-parallel)
            B  output projection; its reduction           E  GeLU (or SwiGLU) + fc2; its reduction
            C  its sum; residual add; LN2                 F  its sum; residual add

        Args:
            hidden: ``[s, b, h]``, or with sequence parallelism this rank's ``[s/tp, b, h]`` slice (the norms and
                residual adds then run on the slice).
            attend_mask, rotary: as in :meth:`ParallelSelfAttention.context` (a batch chunk's, under Domino).
            reducer: when the communication happens: :data:`SYNCHRONOUS` reduces where it is asked (the plain
                forward); the overlapped stacks launch at B and E and wait at C and F, after the other chunks'
                steps, and place their gradient guards (or sequence-parallel gathers) at the column inputs.
            site: the layer and chunk, for the labels of the reducer's collectives (None: unlabelled).
            kv_cache: generation's cache; only with the synchronous reducer.

        Returns:
            A generator that yields between the steps and returns the layer's output (``run_to_end`` runs it).
        """
        attention, mlp = self.attention, self.mlp
        ready = reducer.column_input(self.input_layernorm(hidden), "attention", site)
        yield
        q, k, v = attention.qkv(*ready())  # A: QKV (its backward reduces the input gradient), then attention
        ctx = attention_step(attention_context, self, q, k, v, attend_mask, kv_cache, rotary)
        del q, k, v
        del ready  # with SP it holds the gathered sequence: the linear kept only its slice
        yield
        pending = reducer.reduce(attention.dense, attention.dense.product(ctx), "attention", site)  # B
        del ctx  # this frame lives until F: without autograd nothing else would keep the context
        yield
        hidden, normed = pending.finish_norm(hidden, self, self.post_attention_layernorm)  # C
        ready = reducer.column_input(normed, "mlp", site)
        yield
        inner = mlp.inner(*ready())  # D
        del ready
        yield
        pending = reducer.reduce(mlp.dense_4h_to_h, mlp_output_step(mlp_output, self, inner), "mlp", site)  # E
        del inner  # as ctx above
        yield
        return pending.finish(hidden, self)  # F
