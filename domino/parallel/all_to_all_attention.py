"""Context parallelism's attention by all-to-all over heads (``--cp-comm-type a2a``, DeepSpeed-Ulysses).

Each of the ``N`` ranks of a context-parallel group holds its two load-balanced chunks of every sequence, ``r`` and
``2N - 1 - r`` (:mod:`domino.parallel.context_split`), for all of its heads. One all-to-all trades that for the
whole sequence of ``1 / N`` of the heads: rank ``j`` receives head group ``j`` of every rank's tokens (queries, keys
and values in one buffer: one collective, and GQA key heads split into the same ``N`` groups, so query head ``h``
still meets key head ``h // (H / G)``). The ``2N`` chunks received are put in position order, attention runs as it
does at CP 1 (causal SDPA over the whole sequence, any kernel the device has: on CUDA FlashAttention or
memory-efficient attention, dropout included; on CPU its fused kernel, or with dropout the math one), the output is
put back in the ranks' chunk order and a second all-to-all returns to every rank its own tokens, all heads (a
per-document mask of the whole sequence, ``--reset-attention-mask``, applies as it does at CP 1, and so does
attention dropout; the batch's document starts of this rank's chunks are all-gathered into the whole sequence's
first, ``b S`` integers). Backward is autograd's: an all-to-all is its own adjoint
(:func:`domino.parallel.collectives.all_to_all_region`).

Transformer Engine's ``AttnFuncWithCPAndQKVOA2A`` (Megatron-LM's ``--cp-comm-type a2a``;
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``: ``flash_attn_a2a_communicate``
with ``get_seq_chunk_ids_for_reordering_before_attn`` / ``_after_attn``, the same chunk order) and DeepSpeed's
``DistributedAttention`` (``deepspeed/sequence/layer.py``, 0.19.8: "Number of heads ... must be divisible by the
sequence parallel size") do the same.

Against the ring (``p2p``, :mod:`domino.parallel.ring_attention`): each rank sends ``(N - 1) / N`` of its queries,
keys, values and output once per layer and direction, whatever ``N``, where the ring passes every key/value block
``N - 1`` times but hides the passing under the blocks' compute; the all-to-all cannot be hidden (attention needs
every piece), it needs the heads (and key heads) per TP rank divisible by ``N``, and it runs one whole-sequence
kernel instead of ``N`` blocks merged by their log-sum-exp.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from domino.parallel.collectives import all_to_all_region
from domino.parallel.document_attention import document_attention, is_document_starts
from domino.parallel.kernels import Kernels
from domino.parallel.random import tp_region_rng
from domino.runtime.mesh import MeshGroup


def chunk_orders(n: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(to_positions, to_ranks)`` over the ``2N`` chunks of a sequence received rank after rank (rank ``i``'s
    chunks ``i`` and ``2N - 1 - i``): ``received[to_positions]`` is in position order, ``ordered[to_ranks]`` in the
    ranks' order again. Built on ``device`` from ``arange`` (no tensor made from host numbers)."""
    k = torch.arange(2 * n, device=device)
    to_positions = torch.where(k < n, 2 * k, 4 * n - 1 - 2 * k)  # chunk k < N is rank k's first, else 2N-1-k's second
    to_ranks = torch.where(k % 2 == 0, k // 2, 2 * n - 1 - k // 2)
    return to_positions, to_ranks


def whole_starts(starts: torch.Tensor, cp: MeshGroup) -> torch.Tensor:
    """The document starts ``[b, S]`` of the whole sequence in position order, from every rank's chunks' ``[b, s]``
    (one all-gather of ``b s`` integers a rank, no gradient: positions are not learned)."""
    n = cp.size
    pieces = [torch.empty_like(starts) for _ in range(n)]
    dist.all_gather(pieces, starts.contiguous(), group=cp.process_group)
    b, s = starts.shape
    to_positions, _ = chunk_orders(n, starts.device)
    chunks = torch.stack(pieces).view(n, b, 2, s // 2).transpose(1, 2).reshape(2 * n, b, s // 2)
    return chunks.index_select(0, to_positions).permute(1, 0, 2).reshape(b, n * s)


def _by_head_group(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[b, X, s, d]`` -> ``[N, s, b, X / N, d]`` (views): head group ``j`` of this rank's tokens, for rank ``j``."""
    b, heads, s, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(s, b, n, heads // n, d).permute(2, 0, 1, 3, 4)


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: MeshGroup,
                         scale: Optional[float] = None, attend_mask: Optional[torch.Tensor] = None,
                         dropout: float = 0.0, kernels: Optional[Kernels] = None) -> torch.Tensor:
    """Causal attention of this rank's two load-balanced chunks over the whole sequence held by ``cp``, by
    exchanging sequence for heads (module docstring); the interface of
    :func:`domino.parallel.ring_attention.ring_attention`.

    Args:
        q: ``[b, H, s, d]`` queries of this rank's chunks ``r`` and ``2N - 1 - r``, in that order, rotated.
        k, v: ``[b, G, s, d]`` keys (rotated) and values of the same tokens (``G`` divides ``H``: GQA).
        cp: the context-parallel group; ``H`` and ``G`` must be divisible by its size.
        scale: the score scale (default ``1 / sqrt(d)``).
        attend_mask: None for plain causal attention; int ``[b, s]`` document starts of this rank's tokens
            (gathered into the whole sequence's, :func:`whole_starts`); or bool ``[b or 1, 1, S, S]`` of the whole
            sequence in position order, True = may attend (each rank sees the whole sequence here).
        dropout: attention dropout, drawn from the TP stream (:func:`domino.parallel.random.tp_region_rng`),
            which differs per TP and CP rank: each rank's head group draws its own masks.
        kernels: the per-document attention's kernel choice (given by ``parallelize``); None: the device's.

    Returns:
        ``[b, H, s, d]`` attention output in ``q``'s dtype (a view of ``[s, b, H, d]`` memory).
    """
    n = cp.size
    heads, groups = q.shape[1], k.shape[1]
    causal = attend_mask is None
    documents = is_document_starts(attend_mask)
    if n == 1:
        with tp_region_rng(dropout > 0):
            if documents:
                return document_attention(q, k, v, attend_mask, dropout, scale, kernels)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attend_mask, dropout_p=dropout, is_causal=causal,
                                                  scale=scale, enable_gqa=groups != heads)
    b, _, s, d = q.shape
    if heads % n or groups % n:
        raise ValueError(f"all-to-all attention splits the heads over {n} context-parallel ranks: {heads} query "
                         f"and {groups} key/value heads per rank are not both divisible by {n}")
    if s % 2:
        raise ValueError(f"context parallelism needs an even number of local tokens (two chunks), got {s}")
    to_positions, to_ranks = chunk_orders(n, q.device)
    # One send buffer for q, k and v: [N, s, b, (H + 2G) / N, d], piece j for rank j.
    send = torch.cat([_by_head_group(t, n) for t in (q, k, v)], dim=3)
    received = all_to_all_region(send, cp)  # piece i: rank i's two chunks of this rank's head group
    width = received.shape[3]
    whole = received.reshape(2 * n, s // 2, b, width, d).index_select(0, to_positions).view(n * s, b, width, d)
    hq, hg = heads // n, groups // n
    q_all, k_all, v_all = (t.permute(1, 2, 0, 3) for t in whole.split([hq, hg, hg], dim=2))
    with tp_region_rng(dropout > 0):  # this rank's heads: the TP stream (its seed differs per TP and CP rank)
        if documents:  # as at CP 1 (its device's kernel), over the whole sequence's starts
            out = document_attention(q_all, k_all, v_all, whole_starts(attend_mask, cp), dropout, scale,
                                     kernels)
        else:
                out = F.scaled_dot_product_attention(q_all, k_all, v_all, attn_mask=attend_mask, dropout_p=dropout,
                                                 is_causal=causal, scale=scale, enable_gqa=hg != hq)
    # [b, H/N, S, d] -> the ranks' chunk order [N, s, b, H/N, d] -> piece i back to rank i.
    back = out.permute(2, 0, 1, 3).reshape(2 * n, s // 2, b, hq, d).index_select(0, to_ranks)
    mine = all_to_all_region(back.view(n, s, b, hq, d), cp)  # piece j: this rank's tokens, head group j
    return mine.permute(1, 2, 0, 3, 4).reshape(s, b, heads, d).permute(1, 2, 0, 3)
