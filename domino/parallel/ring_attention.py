"""Context parallelism's attention: causal ring attention over a context-parallel group, load balanced.

Each of the ``N`` ranks of the group holds two of the sequence's ``2N`` equal chunks, ``r`` and ``2N - 1 - r``
(:mod:`domino.parallel.context_split`), so that under a causal mask every rank does the same work. Attention needs
every earlier token's key and value: the ranks' key/value blocks travel around the ring (rank ``r`` sends to
``r + 1``), and after ``N`` steps each rank has seen every block. At step ``i`` rank ``r`` holds the block of rank
``j = (r - i) mod N``, and which of its queries may see which keys follows from the chunk order alone::

    i = 0   (j = r)  both query chunks x both key chunks, causal (the two local chunks in position order)
    j < r            both query chunks x key chunk j only: chunk j precedes both, chunk 2N-1-j follows both
    j > r            query chunk 2N-1-r only x both key chunks: both precede it, both follow chunk r

Each block's attention comes with the log-sum-exp of its scores, and the partial results merge exactly:
``lse = logaddexp(lse, lse_i)``, ``out = out e^(lse_old - lse) + out_i e^(lse_i - lse)`` (the schedule of
Megatron-LM's context parallelism, ``AttnFuncWithCPAndKVP2P`` in Transformer Engine
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``, and of torch's
``_templated_ring_attention``, ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``, 2.13).
Backward walks the ring again: every block's gradient is the block kernel's backward given the *merged* output and
log-sum-exp (the softmax of the whole row, restricted to the block), the query gradient stays, and the key/value
gradient travels with its block back to the rank that owns it.

Why not torch's ``context_parallel``: it dispatches on the CUDA SDPA ops only (flash, memory-efficient, cuDNN; not
``_scaled_dot_product_flash_attention_for_cpu``), takes a DTensor ``DeviceMesh`` and shards buffers in place by
its own load balancer; domino's model runs SDPA on CPU and GPU under one mesh value, so the ring is written here,
over the same SDPA kernels where they return their log-sum-exp: SDPA's fused CPU kernel, on CUDA FlashAttention or
memory-efficient attention, else the textbook softmax (:mod:`domino.parallel.attention_blocks`, chosen by
:func:`domino.parallel.kernels.ring_block_kernel`; the CUDA blocks have not yet run on a GPU).

Every key/value transfer of step ``i + 1`` is in flight while block ``i`` is computed (forward and backward), and
every gradient transfer while the next block's gradient is computed.

A per-document mask (``--reset-attention-mask``) is causal, so the same visibility holds. The batch gives each rank
its chunks' document starts only (:mod:`domino.parallel.document_attention`): documents are contiguous, so a block
splits into per-document sub-blocks (a document's rows times its keys in the block: a causal square on the diagonal,
a whole rectangle elsewhere), each run by the block kernel and written into the block's output and log-sum-exp; no
mask is built (the plain choice builds the block's part of the dense mask from the starts, the reference). A dense
whole-sequence mask is still taken: each block reads its rows and columns of it. A row a block hides whole
contributes nothing (``lse = -inf``). Attention
dropout is applied block by block to the probabilities the block's own log-sum-exp normalises: the merge rescales
them to the whole row's softmax, so every kept probability ends up scaled as unsplit dropout scales it. The masks
are drawn from the TP stream in forward and drawn again, in the same order, from the generator state forward
started with; the CUDA blocks draw their own (philox, from the same stream) and each block's backward is handed
the RNG state its forward returned (:class:`domino.parallel.attention_blocks.BlockKernels`).
"""

from __future__ import annotations

import contextlib
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from domino.parallel.context_split import local_token_indices
from domino.parallel.document_attention import (Pieces, attend_mask_of, block_documents, document_attention,
                                                documents_backward, documents_forward, is_document_starts)
from domino.parallel.attention_blocks import BlockKernels
from domino.parallel.kernels import Kernels, resolve, ring_block_kernel
from domino.parallel.random import device_rng_state, replaying_rng, tp_region_rng
from domino.runtime.mesh import MeshGroup

KV_TAG, GRAD_TAG = 0, 1  # the two transfers may be in flight at once between the same pair of ranks


def _block_kernels(q: torch.Tensor, k: torch.Tensor, attend_mask: Optional[torch.Tensor],
                   dropout: float, kernels: Kernels) -> BlockKernels:
    """The kernel of this call's blocks, as :func:`domino.parallel.kernels.ring_block_kernel` chooses it from
    ``kernels`` (the one place): whether the blocks carry a dense mask follows from the mask and the
    document-attention choice."""
    masked = attend_mask is not None and (not is_document_starts(attend_mask)
                                          or kernels.document_attention == "dense")
    return BlockKernels(ring_block_kernel(kernels, q, k, dropout, masked))


def _keep_mask(shape: Tuple[int, ...], dropout: float, device: torch.device) -> torch.Tensor:
    """One block's dropout mask (True = kept), from the generator the ring runs under (the TP stream)."""
    return torch.rand(shape, device=device) >= dropout


def _shift(tensor: torch.Tensor, cp: MeshGroup, tag: int) -> Tuple[torch.Tensor, List[dist.Work]]:
    """Starts sending ``tensor`` to the next rank of the ring and receiving the previous rank's into a new buffer;
    returns the buffer and the requests to wait on before reading it (or overwriting ``tensor``)."""
    received = torch.empty_like(tensor)
    nxt, prev = cp.ranks[(cp.rank + 1) % cp.size], cp.ranks[(cp.rank - 1) % cp.size]
    ops = [dist.P2POp(dist.isend, tensor, nxt, cp.process_group, tag),
           dist.P2POp(dist.irecv, received, prev, cp.process_group, tag)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: Optional[List[dist.Work]]) -> None:
    for request in requests or ():
        request.wait()


def _block_of(step: int, cp: MeshGroup, half: int) -> Tuple[int, bool, slice, slice]:
    """The block held at ``step``: ``(owner, causal, rows, keys)``, the rank whose keys/values it is, whether it is
    the causal diagonal, and which of this rank's query rows see which of the block's key positions."""
    owner = (cp.rank - step) % cp.size
    if step == 0:
        return owner, True, slice(None), slice(None)
    if owner < cp.rank:  # chunk `owner` precedes both query chunks, chunk 2N-1-owner follows both
        return owner, False, slice(None), slice(0, half)
    return owner, False, slice(half, None), slice(None)  # both key chunks precede chunk 2N-1-r only


class _Block(NamedTuple):
    """What one step computes: the held block's part that this rank's query rows ``rows`` see (key positions
    ``keys``), its inputs, its part of the mask, its dropout mask (None without), and with document starts and
    the segmented choice, its per-document sub-blocks instead of a mask
    (:func:`domino.parallel.document_attention.block_documents`)."""
    causal: bool
    rows: slice
    keys: slice
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    keep: Optional[torch.Tensor]
    pieces: Optional[Pieces] = None


def _block(step: int, cp: MeshGroup, q: torch.Tensor, held: torch.Tensor, rows_mask: Optional[torch.Tensor],
           dropout: float, draws_masks: bool, dense_documents: bool) -> _Block:
    """Step ``step``'s block, forward and backward alike (backward draws the same dropout masks, in order; with
    ``draws_masks`` False the block kernel draws its own; with ``dense_documents`` document starts become the
    block's part of the dense mask, the reference, else per-document sub-blocks)."""
    half = q.shape[2] // 2
    owner, causal, rows, keys = _block_of(step, cp, half)
    bq, bk, bv = q[:, :, rows], held[0][:, :, keys], held[1][:, :, keys]
    keep = _keep_mask((*bq.shape[:3], bk.shape[2]), dropout, q.device) if dropout > 0 and draws_masks else None
    if is_document_starts(rows_mask):  # this rank's chunks' document starts: the block's from positions
        starts = rows_mask[:, rows]
        q_pos = _positions(cp.rank, cp, half, q.device)[rows]
        k_pos = _positions(owner, cp, half, q.device)[keys]
        if dense_documents:  # the reference: the block's part of the mask
            return _Block(causal, rows, keys, bq, bk, bv, attend_mask_of(starts, q_pos, k_pos), keep)
        return _Block(causal, rows, keys, bq, bk, bv, None, keep, block_documents(starts, q_pos, k_pos))
    return _Block(causal, rows, keys, bq, bk, bv, _mask_block(rows_mask, owner, cp, half, rows, keys), keep)


def _positions(rank: int, cp: MeshGroup, half: int, device: torch.device) -> torch.Tensor:
    """The positions in the whole sequence of the two chunks rank ``rank`` of ``cp`` holds (chunks of ``half``)."""
    return local_token_indices(2 * cp.size * half, MeshGroup.shapes_only(cp.size, rank), device)


def _block_forward(forward, block: _Block, scale: float, dropout: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The block kernel's ``(out, lse)`` on the block, or on each of its per-document sub-blocks."""
    if block.pieces is not None:
        return documents_forward(forward, block.q, block.k, block.v, block.causal, scale, block.pieces, block.keep,
                                 dropout)
    return forward(block.q, block.k, block.v, block.causal, scale, block.mask, block.keep, dropout)


def _mask_rows(attend_mask: Optional[torch.Tensor], cp: MeshGroup, half: int) -> Optional[torch.Tensor]:
    """The rows of this rank's two chunks of a whole-sequence mask ``[b or 1, 1, S, S]``: ``[b or 1, 1, s, S]``;
    document starts (already this rank's chunks', ``[b, s]``) as they are."""
    if attend_mask is None or is_document_starts(attend_mask):
        return attend_mask
    r, last = cp.rank, 2 * cp.size - 1
    return torch.cat((attend_mask[:, :, r * half:(r + 1) * half],
                      attend_mask[:, :, (last - r) * half:(last - r + 1) * half]), dim=2)


def _mask_block(rows_mask: Optional[torch.Tensor], owner: int, cp: MeshGroup, half: int, rows: slice,
                keys: slice) -> Optional[torch.Tensor]:
    """The part of this rank's mask rows a block covers: the owner's two chunks' columns, then ``rows, keys``."""
    if rows_mask is None:
        return None
    last = 2 * cp.size - 1
    columns = torch.cat((rows_mask[..., owner * half:(owner + 1) * half],
                         rows_mask[..., (last - owner) * half:(last - owner + 1) * half]), dim=-1)
    return columns[:, :, rows, keys]


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merges one block's result into the running fp32 ``out``/``lse`` (views of the rows it covers), in place. The
    running ``lse`` is finite (the diagonal holds every row's own token); a row the block hides has ``-inf``."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: MeshGroup, scale: float,
                attend_mask: Optional[torch.Tensor], dropout: float, choice: Kernels):
        kernels = _block_kernels(q, k, attend_mask, dropout, choice)
        dense = choice.document_attention == "dense"
        draws = dropout > 0 and kernels.draws_masks
        rows_mask = _mask_rows(attend_mask, cp, q.shape[2] // 2)
        rng = device_rng_state(q.device) if draws else None  # backward replays the blocks' dropout masks
        held = torch.stack((k, v))  # [2, b, G, s, d]: one contiguous buffer travels the ring
        out = lse = None
        for step in range(cp.size):
            # Launch: the next step's block in flight while this one is computed; waited at the end of the step.
            incoming, requests = _shift(held, cp, KV_TAG) if step + 1 < cp.size else (None, None)
            block = _block(step, cp, q, held, rows_mask, dropout, draws, dense)
            block_out, block_lse = _block_forward(kernels.forward, block, scale, dropout)
            if block.causal:
                out, lse = block_out.float(), block_lse
            else:
                _merge(out[:, :, block.rows], lse[:, :, block.rows], block_out, block_lse)
            _wait(requests)  # wait: the next block has arrived (and ours has left)
            held = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, attend_mask, rng)
        ctx.cp, ctx.scale, ctx.dropout, ctx.kernels, ctx.dense = cp, scale, dropout, kernels, dense
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse, attend_mask, rng = ctx.saved_tensors
        cp, scale, dropout, kernels = ctx.cp, ctx.scale, ctx.dropout, ctx.kernels
        kernels.start_backward()  # the fused blocks' dropout: each block's RNG state, in the forward's order
        backward = kernels.backward
        rows_mask = _mask_rows(attend_mask, cp, q.shape[2] // 2)
        dout = dout.contiguous()
        held = torch.stack((k, v))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads, grad_requests = None, None  # the key/value gradient of the block held, travelling with it
        with replaying_rng(rng, q.device) if rng is not None else contextlib.nullcontext():
            for step in range(cp.size):
                # Launch: the next step's block in flight while this one's gradient is computed.
                incoming, requests = _shift(held, cp, KV_TAG) if step + 1 < cp.size else (None, None)
                block = _block(step, cp, q, held, rows_mask, dropout, rng is not None, ctx.dense)
                rows, keys = block.rows, block.keys
                given = (dout[:, :, rows], block.q, block.k, block.v, out[:, :, rows], lse[:, :, rows], block.causal,
                         scale)
                if block.pieces is not None:
                    bdq, bdk, bdv = documents_backward(backward, *given, block.pieces, block.keep, dropout)
                else:
                    bdq, bdk, bdv = backward(*given, block.mask, block.keep, dropout)
                dq[:, :, rows] += bdq
                _wait(grad_requests)  # wait: the gradient so far of the block held has arrived from the previous rank
                if grads is None:  # the first step: the block's gradient starts here
                    grads = torch.zeros(held.shape, dtype=torch.float32, device=q.device)
                grads[0, :, :, keys] += bdk  # into the travelling buffer itself: no per-step zeroed copy
                grads[1, :, :, keys] += bdv
                # Launch: this block's gradient on to the next rank (the last step's reaches the block's owner),
                # in flight while the next block's gradient is computed; waited at the next step or after the loop.
                sending = grads  # kept alive until its send is waited on
                grads, grad_requests = _shift(sending, cp, GRAD_TAG)
                _wait(requests)  # wait: the next block has arrived
                held = incoming
        _wait(grad_requests)  # wait: our own block's gradient, summed over every rank's queries, is back
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: MeshGroup,
                   scale: Optional[float] = None, attend_mask: Optional[torch.Tensor] = None,
                   dropout: float = 0.0, kernels: Optional[Kernels] = None) -> torch.Tensor:
    """Causal attention of this rank's two load-balanced chunks over the whole sequence held by ``cp``.

    Args:
        q: ``[b, H, s, d]`` queries of this rank's chunks ``r`` and ``2N - 1 - r``, in that order, rotated.
        k, v: ``[b, G, s, d]`` keys (rotated) and values of the same tokens (``G`` divides ``H``: GQA).
        cp: the context-parallel group; at size 1 this is plain causal SDPA.
        scale: the score scale (default ``1 / sqrt(d)``).
        attend_mask: None for plain causal attention; int ``[b, s]`` document starts of this rank's tokens (each
            block is cut into per-document sub-blocks; the plain choice builds the block's part of the dense mask
            from them instead); or bool ``[b or 1, 1, S, S]`` of the whole sequence in position order, True = may
            attend; it must be causal (per-document masks are): each block reads the part of it its queries and
            keys cover.
        dropout: attention dropout, drawn block by block from the TP stream
            (:func:`domino.parallel.random.tp_region_rng`, which differs per TP and CP rank) and replayed in
            backward (on CPU the blocks then run the textbook softmax: SDPA's fused CPU kernel has no dropout; the
            CUDA blocks draw it themselves and replay it from their RNG states).
        kernels: the attention's kernel choice (given by ``parallelize``); None: the device's.

    Returns:
        ``[b, H, s, d]`` attention output in ``q``'s dtype, as SDPA's.
    """
    kernels = resolve(kernels, q.device)
    if cp.size == 1:
        with tp_region_rng(dropout > 0):
            if is_document_starts(attend_mask):
                return document_attention(q, k, v, attend_mask, dropout, scale, kernels)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attend_mask, dropout_p=dropout,
                                                  is_causal=attend_mask is None, scale=scale,
                                                  enable_gqa=k.shape[1] != q.shape[1])
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even number of local tokens (two chunks), got {q.shape[2]}")
    with tp_region_rng(dropout > 0):  # the blocks' dropout masks: this rank's stream
        return _RingAttention.apply(q, k, v, cp, scale if scale is not None else q.shape[-1] ** -0.5, attend_mask,
                                    dropout, kernels)
