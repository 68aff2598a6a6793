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
over the same SDPA kernels where they return their log-sum-exp (:mod:`domino.parallel.kernels`).

Every key/value transfer of step ``i + 1`` is in flight while block ``i`` is computed (forward and backward), and
every gradient transfer while the next block's gradient is computed. Attention dropout and masks are not applied
(refused with ``--cp-comm-type p2p`` by :func:`domino.config.layout.context_parallel_problems`; the all-to-all
attention takes both).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from domino.parallel.kernels import kernels_for
from domino.runtime.mesh import MeshGroup

KV_TAG, GRAD_TAG = 0, 1  # the two transfers may be in flight at once between the same pair of ranks


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Textbook attention of ``[b, H, s, d]`` queries over ``[b, G, t, d]`` keys/values (GQA: key head ``j`` serves
    query heads ``j n .. j n + n - 1``): ``(out [b, H, s, d], lse [b, H, s] fp32)``."""
    b, heads, s, d = q.shape
    groups = k.shape[1]
    qg = q.float().reshape(b, groups, heads // groups, s, d)
    scores = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale  # [b, G, n, s, t]
    if causal:
        scores = scores.masked_fill(torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float().unsqueeze(2))
    return out.reshape(b, heads, s, d).to(q.dtype), lse.reshape(b, heads, s)


def _math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> Tuple[torch.Tensor, ...]:
    """Gradients of one block given the merged ``out`` and ``lse`` of the whole rows: ``(dq, dk, dv)`` in fp32."""
    b, heads, s, d = q.shape
    groups, n = k.shape[1], heads // k.shape[1]

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return x.float().reshape(b, groups, n, *x.shape[2:])

    qg, dog, og, lg = grouped(q), grouped(dout), grouped(out), grouped(lse)
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    scores = torch.matmul(qg, kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    probs = torch.exp(scores - lg.unsqueeze(-1))  # the whole row's softmax, on this block's keys
    dv = torch.matmul(probs.transpose(-1, -2), dog).sum(2)
    dprobs = torch.matmul(dog, vf.transpose(-1, -2))
    dscores = probs * (dprobs - (dog * og).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(dscores, kf).reshape(b, heads, s, d)
    dk = torch.matmul(dscores.transpose(-1, -2), qg).sum(2)
    return dq, dk, dv


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fused_cpu_forward(q, k, v, causal, scale):
    """SDPA's fused CPU kernel, which returns the block's log-sum-exp (GQA keys expanded to the query heads)."""
    heads = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expand(k, heads), _expand(v, heads), 0.0, causal, scale=scale)
    return out, lse


def _fused_cpu_backward(dout, q, k, v, out, lse, causal, scale):
    heads, groups = q.shape[1], k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, _expand(k, heads), _expand(v, heads), out, lse, 0.0, causal, scale=scale)
    if groups != heads:  # each key head's gradient is the sum over the query heads it served
        dk, dv = (g.reshape(g.shape[0], groups, heads // groups, *g.shape[2:]).sum(2) for g in (dk, dv))
    return dq.float(), dk.float(), dv.float()


def _block_kernels(device: torch.device):
    """``(forward, backward)`` of one block on ``device``: the one place they are chosen."""
    if kernels_for(device).ring_blocks_fused:
        return _fused_cpu_forward, _fused_cpu_backward
    return _math_forward, _math_backward


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


def _block_of(step: int, cp: MeshGroup) -> Tuple[int, str]:
    """The owner of the key/value block held at ``step`` and which part of it this rank's queries see."""
    owner = (cp.rank - step) % cp.size
    return owner, "diagonal" if step == 0 else ("earlier" if owner < cp.rank else "later")


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merges one block's result into the running fp32 ``out``/``lse`` (views of the rows it covers), in place."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: MeshGroup, scale: float):
        forward, _ = _block_kernels(q.device)
        half = q.shape[2] // 2
        held = torch.stack((k, v))  # [2, b, G, s, d]: one contiguous buffer travels the ring
        out = lse = None
        for step in range(cp.size):
            # Launch: the next step's block in flight while this one is computed; waited at the end of the step.
            incoming, requests = _shift(held, cp, KV_TAG) if step + 1 < cp.size else (None, None)
            _, part = _block_of(step, cp)
            bk, bv = held[0], held[1]
            if part == "diagonal":
                block_out, lse = forward(q, bk, bv, True, scale)
                out = block_out.float()
            elif part == "earlier":
                block_out, block_lse = forward(q, bk[:, :, :half], bv[:, :, :half], False, scale)
                _merge(out, lse, block_out, block_lse)
            else:
                block_out, block_lse = forward(q[:, :, half:], bk, bv, False, scale)
                _merge(out[:, :, half:], lse[:, :, half:], block_out, block_lse)
            _wait(requests)  # wait: the next block has arrived (and ours has left)
            held = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.scale = cp, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        _, backward = _block_kernels(q.device)
        half = q.shape[2] // 2
        dout = dout.contiguous()
        held = torch.stack((k, v))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grads, grad_requests = None, None  # the key/value gradient of the block held, travelling with it
        for step in range(cp.size):
            # Launch: the next step's block in flight while this one's gradient is computed.
            incoming, requests = _shift(held, cp, KV_TAG) if step + 1 < cp.size else (None, None)
            _, part = _block_of(step, cp)
            bk, bv = held[0], held[1]
            keys = slice(None)  # the key positions of the held block these queries see
            if part == "diagonal":
                bq, bkk, bvv = backward(dout, q, bk, bv, out, lse, True, scale)
                dq += bq
            elif part == "earlier":
                keys = slice(0, half)
                bq, bkk, bvv = backward(dout, q, bk[:, :, keys], bv[:, :, keys], out, lse, False, scale)
                dq += bq
            else:
                bq, bkk, bvv = backward(dout[:, :, half:], q[:, :, half:], bk, bv, out[:, :, half:],
                                        lse[:, :, half:], False, scale)
                dq[:, :, half:] += bq
            _wait(grad_requests)  # wait: the gradient so far of the block held has arrived from the previous rank
            if grads is None:  # the first step: the block's gradient starts here
                grads = torch.zeros(held.shape, dtype=torch.float32, device=q.device)
            grads[0, :, :, keys] += bkk  # into the travelling buffer itself: no per-step zeroed copy
            grads[1, :, :, keys] += bvv
            # Launch: this block's gradient on to the next rank (the last step's reaches the block's owner),
            # in flight while the next block's gradient is computed; waited at the next step or after the loop.
            sending = grads  # kept alive until its send is waited on
            grads, grad_requests = _shift(sending, cp, GRAD_TAG)
            _wait(requests)  # wait: the next block has arrived
            held = incoming
        _wait(grad_requests)  # wait: our own block's gradient, summed over every rank's queries, is back
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: MeshGroup,
                   scale: Optional[float] = None, attend_mask: Optional[torch.Tensor] = None,
                   dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's two load-balanced chunks over the whole sequence held by ``cp``.

    Args:
        q: ``[b, H, s, d]`` queries of this rank's chunks ``r`` and ``2N - 1 - r``, in that order, rotated.
        k, v: ``[b, G, s, d]`` keys (rotated) and values of the same tokens (``G`` divides ``H``: GQA).
        cp: the context-parallel group; at size 1 this is plain causal SDPA.
        scale: the score scale (default ``1 / sqrt(d)``).
        attend_mask: must be None: the ring's blocks are plain causal (a per-document mask needs
            :func:`domino.parallel.all_to_all_attention.all_to_all_attention`).
        dropout: must be 0: the blocks run without dropout (the all-to-all attention applies it).

    Returns:
        ``[b, H, s, d]`` attention output in ``q``'s dtype, as SDPA's.
    """
    if attend_mask is not None or dropout > 0:
        raise ValueError("ring attention is plain causal without dropout: an attention mask or attention dropout "
                         "needs --cp-comm-type a2a")
    if cp.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs an even number of local tokens (two chunks), got {q.shape[2]}")
    return _RingAttention.apply(q, k, v, cp, scale if scale is not None else q.shape[-1] ** -0.5)
