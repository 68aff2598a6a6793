"""Per-document causal attention from the documents' starts, without an ``s x s`` mask (``--reset-attention-mask``).

A packed sample holds documents back to back, and a token attends to the earlier tokens of its own document only.
The batch carries that as *document starts*: an int64 ``[b, s]`` tensor giving, for every token, the position where
its document begins (:func:`domino.data.batch.get_ltor_masks_and_position_ids`). The token at position ``p`` may
attend to the key at position ``u`` iff ``start[p] <= u <= p``: documents are contiguous, so that is the causal mask
cut to the document. It costs 8 bytes a token where Megatron's dense ``[b, 1, s, s]`` mask costs ``s`` (1 GiB a
sample at 32k tokens); Megatron-LM's packed sequences carry the same boundaries as ``cu_seqlens``
(``PackedSeqParams``, ``megatron/core/packed_seq_params.py``) for Transformer Engine's THD kernels.

Three ways to run it, chosen per device by :mod:`domino.parallel.kernels` (``Kernels.document_attention``):

* ``dense``, the reference (``DOMINO_KERNELS=plain``): the ``[b, 1, s, s]`` mask built from the starts, which is
  Megatron's ``get_ltor_masks_and_position_ids`` mask, handed to SDPA.
* ``segmented`` (CPU): each document of each sample through causal SDPA, whose fused CPU kernel keeps memory linear
  in the document; the documents' lengths are read on the host, which costs nothing on CPU.
* ``varlen`` (CUDA): the batch packed as one ``[b s, heads, d]`` (THD) sequence through FlashAttention's varlen
  kernel, ``aten::_flash_attention_forward`` / ``_flash_attention_backward`` with ``cum_seq_q = cum_seq_k =
  cu_seqlens`` (torch 2.13 ``torchgen/packaged/ATen/native/native_functions.yaml``; flash-attn's
  ``flash_attn_varlen_func``); grouped-query keys go in unexpanded, as flash takes them. **It has not run on a GPU**:
  its packing and gradients are tested on CPU with a CPU stand-in for the two flash ops. FlashAttention takes
  fp16 and bf16 only: fp32 inputs take the segmented way on CUDA too (SDPA picks its kernel per document). It reads the number of
  documents and the longest one on the host once per batch (kept on the starts tensor, which every layer is
  given), where a ``cu_seqlens`` built with the batch on the host would read nothing.

Attention dropout keeps the RNG convention of the dense path (the caller's TP stream); the segmented path draws its
masks document by document, so its dropped positions differ from the dense path's (equal in law, not in bits).

Under context parallelism each rank holds only its chunks' starts (:func:`domino.parallel.context_split.split_batch`
cuts them as it cuts the tokens). The ring (:mod:`domino.parallel.ring_attention`) cuts each of its blocks into
per-document sub-blocks (:func:`block_documents`, run by :func:`documents_forward` / :func:`documents_backward`);
the all-to-all gathers the starts of the whole sequence (``b S`` integers) and runs :func:`document_attention`.
"""

from __future__ import annotations

import bisect
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from domino.parallel.kernels import Kernels, resolve

#: Per sample, the ``(row_begin, row_end, key_begin, key_end)`` sub-blocks of one attention block.
Pieces = List[List[Tuple[int, int, int, int]]]


def is_document_starts(mask: Optional[torch.Tensor]) -> bool:
    """Whether an attention mask is document starts (int ``[b, s]``) rather than a dense bool mask or None."""
    return mask is not None and mask.dtype != torch.bool


def attend_mask_of(starts: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The dense bool ``[b, 1, sq, sk]`` mask (True = may attend) of queries at positions ``q_pos`` ``[sq]`` with
    document ``starts`` ``[b, sq]`` over keys at positions ``k_pos`` ``[sk]``: ``start[p] <= u <= p``."""
    keys = k_pos.view(1, 1, -1)
    return ((keys >= starts.unsqueeze(-1)) & (keys <= q_pos.view(1, -1, 1))).unsqueeze(1)


def document_lengths(starts: torch.Tensor) -> List[int]:
    """The lengths of the runs of equal starts of one row ``[s]``: its documents (cut by the sequence's ends), read
    on the host."""
    return torch.unique_consecutive(starts, return_counts=True)[1].tolist()


def _check(q: torch.Tensor, starts: torch.Tensor) -> None:
    if tuple(starts.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"document starts of shape {tuple(starts.shape)} for a batch of {q.shape[0]} sequences of "
                         f"{q.shape[2]} tokens")


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                       dropout: float = 0.0, scale: Optional[float] = None, kernels: Optional[Kernels] = None
                       ) -> torch.Tensor:
    """Per-document causal attention of a whole sequence, as ``kernels`` (else its device's) choose (module
    docstring).

    Args:
        q: ``[b, H, s, d]`` queries (rotated).
        k, v: ``[b, G, s, d]`` keys and values (``G`` divides ``H``: GQA).
        starts: int ``[b, s]``: the position where each token's document begins.
        dropout: attention dropout, drawn from the caller's generator (the TP stream).
        scale: the score scale (default ``1 / sqrt(d)``).
        kernels: the kernel choice (given by ``parallelize`` to the attention); None: the device's.

    Returns:
        ``[b, H, s, d]`` in ``q``'s dtype, as SDPA's with the dense mask.
    """
    _check(q, starts)
    choice = resolve(kernels, q.device).document_attention
    if choice == "varlen" and q.dtype in VARLEN_DTYPES:
        return varlen_attention(q, k, v, starts, dropout, scale)
    if choice != "dense":  # segmented, or varlen's inputs in a dtype FlashAttention does not take (fp32)
        return segmented_attention(q, k, v, starts, dropout, scale)
    steps = torch.arange(q.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attend_mask_of(starts, steps, steps), dropout_p=dropout,
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def segmented_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                        dropout: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
    """Each document of each sample through causal SDPA (arguments as :func:`document_attention`).

    The pieces are cut with ``split`` (whose backward concatenates the gradients once) and stay 4-D: SDPA's fused
    CPU kernel takes 4-D inputs only (3-D ones fall back to the math kernel, quadratic in the document)."""
    gqa = k.shape[1] != q.shape[1]
    samples = []
    for qs, ks, vs, row in zip(q.split(1), k.split(1), v.split(1), starts):
        sizes = document_lengths(row)
        samples.append(torch.cat([
            F.scaled_dot_product_attention(a, b, c, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa)
            for a, b, c in zip(qs.split(sizes, 2), ks.split(sizes, 2), vs.split(sizes, 2))], dim=2))
    return torch.cat(samples)


#: The dtypes FlashAttention's kernels take (fp32 goes the segmented way, through SDPA's other CUDA kernels).
VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def flash_varlen_ops() -> Tuple[Callable, Callable]:
    """The two CUDA ops the varlen path calls (a function, so that tests can stand CPU versions in for them)."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


#: The attribute of a starts tensor keeping its ``(cu_seqlens, longest)`` for the next layers of the batch.
CU_SEQLENS = "_domino_cu_seqlens"


def cu_seqlens(starts: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``(cu_seqlens, longest)`` of the documents of ``starts`` ``[b, s]`` packed sample after sample: int32 offsets
    ``[documents + 1]`` into the ``b s`` tokens (a document starts where ``start == position``, and at every
    sample's first token) and the longest document's length (host reads: the count and the maximum)."""
    b, s = starts.shape
    first = starts == torch.arange(s, device=starts.device)
    first[:, 0] = True  # a document cut by the sample's start begins again here
    offsets = torch.nonzero(first.reshape(-1)).reshape(-1)
    total = torch.full((1,), b * s, dtype=offsets.dtype, device=offsets.device)
    cu = torch.cat((offsets, total)).to(torch.int32)
    return cu, int(torch.diff(cu).max())


class _Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, longest: int, dropout: float, scale: Optional[float]):
        forward, _ = flash_varlen_ops()
        out, lse, rng, unused, _ = forward(q, k, v, cu, cu, longest, longest, dropout, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.longest, ctx.dropout, ctx.scale = longest, dropout, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        _, backward = flash_varlen_ops()
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.longest, ctx.longest, ctx.dropout,
                              True, rng, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                     dropout: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
    """FlashAttention's varlen kernel over the batch packed as THD (arguments as :func:`document_attention`).

    ``[b, X, s, d]`` -> ``[b s, X, d]`` (one copy each of q, k, v, as the kernel reads contiguous tokens), the
    output back as a ``[b, H, s, d]`` view. Dropout is the kernel's own (philox, seeded from the current CUDA
    generator: the caller's TP stream), replayed in backward from the ``rng_state`` it returns."""
    b, heads, s, d = q.shape
    if not hasattr(starts, CU_SEQLENS):  # the first layer of the batch reads it; the others find it kept
        setattr(starts, CU_SEQLENS, cu_seqlens(starts))
    cu, longest = getattr(starts, CU_SEQLENS)
    packed = [t.permute(0, 2, 1, 3).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    out = _Varlen.apply(*packed, cu, longest, dropout, scale)
    return out.view(b, s, heads, d).permute(0, 2, 1, 3)


def block_documents(starts: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> Pieces:
    """The per-document sub-blocks of one causal attention block (context parallelism's ring).

    Queries at ascending positions ``q_pos`` ``[sq]`` with document ``starts`` ``[b, sq]`` see keys at ascending
    positions ``k_pos`` ``[sk]``. Documents are contiguous, so a document's rows are a contiguous range and the keys
    they may see another, ``[start, last row's position]``. A ring block is either the diagonal (the same tokens as
    queries and keys: each sub-block is a square, causal from its top-left) or keys that precede every query (each
    sub-block is whole). A document whose keys the block does not hold has no sub-block: its rows get nothing here.
    """
    keys = k_pos.tolist()
    positions = q_pos.tolist()
    pieces: Pieces = []
    for row in starts:
        sample, begin, firsts = [], 0, row.tolist()
        for size in document_lengths(row):
            end = begin + size
            first = bisect.bisect_left(keys, firsts[begin])
            last = bisect.bisect_right(keys, positions[end - 1])
            if last > first:
                sample.append((begin, end, first, last))
            begin = end
        pieces.append(sample)
    return pieces


def _keep_of(keep: Optional[torch.Tensor], i: int, piece: Tuple[int, int, int, int]) -> Optional[torch.Tensor]:
    """A sub-block's part of the block's dropout mask ``[b, H, rows, keys]`` (None without dropout)."""
    r0, r1, k0, k1 = piece
    return None if keep is None else keep[i:i + 1, :, r0:r1, k0:k1]


def documents_forward(forward: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float, pieces: Pieces, keep: Optional[torch.Tensor] = None, dropout: float = 0.0
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One ring block's ``(out, lse)`` by the block kernel ``forward`` run on each sub-block of ``pieces``; a row no
    sub-block covers gets a zero output and ``lse = -inf`` (the merge ignores it), as a masked block's row."""
    b, heads, s, d = q.shape
    out = torch.zeros(b, heads, s, d, dtype=q.dtype, device=q.device)
    lse = torch.full((b, heads, s), float("-inf"), dtype=torch.float32, device=q.device)
    for i, sample in enumerate(pieces):
        for piece in sample:
            r0, r1, k0, k1 = piece
            o, l = forward(q[i:i + 1, :, r0:r1], k[i:i + 1, :, k0:k1], v[i:i + 1, :, k0:k1], causal, scale, None,
                           _keep_of(keep, i, piece), dropout)
            out[i, :, r0:r1] = o[0]
            lse[i, :, r0:r1] = l[0]
    return out, lse


def documents_backward(backward: Callable, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, pieces: Pieces,
                       keep: Optional[torch.Tensor] = None, dropout: float = 0.0) -> Tuple[torch.Tensor, ...]:
    """One ring block's fp32 ``(dq, dk, dv)`` by the block kernel ``backward`` on each sub-block, given the merged
    ``out`` and ``lse`` of the block's rows."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for i, sample in enumerate(pieces):
        for piece in sample:
            r0, r1, k0, k1 = piece
            rows, keys = (slice(i, i + 1), slice(None), slice(r0, r1)), (slice(i, i + 1), slice(None), slice(k0, k1))
            gq, gk, gv = backward(dout[rows], q[rows], k[keys], v[keys], out[rows], lse[rows], causal, scale, None,
                                  _keep_of(keep, i, piece), dropout)
            dq[rows] += gq
            dk[keys] += gk
            dv[keys] += gv
    return dq, dk, dv
