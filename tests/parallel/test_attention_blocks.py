"""The ring's CUDA block kernels (FlashAttention, memory-efficient attention) with CPU stand-ins for their four ATen
ops: the ring through them equals the ring through the textbook blocks, outputs and gradients, on real gloo ranks,
dropout included (the stand-ins prove each block's backward gets its own forward's RNG state); their argument
lists match the real ops' meta kernels; the choice of kernel is :func:`domino.parallel.kernels.ring_block_kernel`'s.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed_helpers import run_distributed
from domino.data.batch import get_ltor_masks_and_position_ids
from domino.parallel import attention_blocks as B
from domino.parallel import kernels as K
from domino.parallel import ring_attention as R
from domino.parallel.context_split import local_token_indices
from domino.parallel.kernels import CPU_KERNELS, CUDA_KERNELS, PLAIN_KERNELS, ring_block_kernel
from domino.runtime.mesh import ParallelMesh


class StandIns:
    """CPU stand-ins for ``aten._scaled_dot_product_flash_attention`` / ``_efficient_attention`` and their backward
    ops, with the real ops' signatures (torch 2.13). Without dropout they run SDPA's fused CPU kernel; with it, the
    textbook block with a mask drawn from a seed taken from the current generator (as philox is seeded), returned
    as the RNG state; backward draws the mask again from the state it is given. They check the arguments the ring
    passes and record the states returned and given back, and the masks drawn (forward, then backward)."""

    def __init__(self):
        self.returned, self.given, self.masks = [], [], []

    def ops(self):
        return self.flash, self.flash_backward, self.efficient, self.efficient_backward

    def _keep(self, seed, shape, p):
        return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) >= p

    def _forward(self, q, k, v, p, causal, scale):
        if p == 0:
            heads = q.shape[1]
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, B.expand_heads(k, heads), B.expand_heads(v, heads), 0.0, causal, scale=scale)
            seed = 0
        else:
            seed = int(torch.randint(0, 2**62, ()))
            keep = self._keep(seed, (*q.shape[:3], k.shape[2]), p)
            self.masks.append(keep)
            out, lse = B.math_forward(q, k, v, causal, scale, None, keep, p)
        state = (torch.tensor([seed, len(self.returned)], dtype=torch.uint64), torch.tensor(len(self.returned)))
        self.returned.append(state)
        return out, lse, state

    def _backward(self, dout, q, k, v, out, lse, p, causal, state, scale):
        self.given.append(state)
        keep = None
        if p > 0:
            keep = self._keep(int(state[0][0]), (*q.shape[:3], k.shape[2]), p)
            self.masks.append(keep)
        return tuple(g.to(q.dtype) for g in B.math_backward(dout, q, k, v, out, lse, causal, scale, None, keep, p))

    def flash(self, q, k, v, dropout_p, is_causal, return_debug_mask, scale=None):
        assert not return_debug_mask and scale is not None
        out, lse, (seed, offset) = self._forward(q, k, v, dropout_p, is_causal, scale)
        return out, lse, None, None, q.shape[2], k.shape[2], seed, offset, torch.empty(0)

    def flash_backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed,
                       offset, scale=None):
        assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[2], k.shape[2])
        assert lse.is_contiguous() and dout.dtype == out.dtype == q.dtype and lse.dtype == torch.float32
        return self._backward(dout, q, k, v, out, lse, dropout_p, is_causal, (seed, offset), scale)

    def efficient(self, q, k, v, bias, compute_lse, dropout_p, is_causal, scale=None):
        assert bias is None and compute_lse and k.shape[1] == q.shape[1]  # keys expanded: no GQA here
        out, lse, (seed, offset) = self._forward(q, k, v, dropout_p, is_causal, scale)
        padded = F.pad(lse, (0, -q.shape[2] % 32), value=float("nan"))  # as CUDA pads it: never to be read
        return out, padded, seed, offset

    def efficient_backward(self, dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask,
                           is_causal, scale=None):
        assert bias is None and grad_input_mask == [True, True, True, False] and k.shape[1] == q.shape[1]
        assert lse.shape[2] % 32 == 0 and lse.shape[2] - q.shape[2] < 32
        grads = self._backward(dout, q, k, v, out, lse[:, :, :q.shape[2]], dropout_p, is_causal, (seed, offset),
                               scale)
        return (*grads, None)


def _starts(b, s):
    g = torch.Generator().manual_seed(13)
    tokens = 1 + torch.randint(0, 5, (b, s), generator=g)
    tokens[:-1][torch.rand(b - 1, s, generator=g) < 0.2] = 0
    return get_ltor_masks_and_position_ids(tokens, 0, False, True, False)[0]


def _cuda_dispatch_body(rank, world_size, cases):
    """Per case ``(kind, dropout, documents)``: the ring with the CUDA choice (``kind`` made the op that fits)
    against the ring with the textbook blocks given the same dropout masks; returns per case the largest error,
    whether each block's backward got its own forward's RNG state, the kind that ran and the blocks' count."""
    cp = ParallelMesh.build(1, context_parallel_size=world_size).cp
    g = torch.Generator().manual_seed(7)
    q, k, v = [torch.randn(2, n, 8 * world_size, 8, generator=g) for n in (4, 2, 2)]
    index = local_token_indices(q.shape[2], cp)
    dout = torch.randn(q.shape, generator=g).index_select(2, index)
    results = []
    for kind, dropout, documents in cases:
        stand = StandIns()
        B.cuda_ops = stand.ops
        K.cuda_attention_fits = lambda which, *_: which == kind
        starts = _starts(2, q.shape[2]).index_select(1, index) if documents else None
        ran = []

        def run(kernels):
            local = [t.index_select(2, index).requires_grad_(True) for t in (q, k, v)]
            torch.manual_seed(100 + rank)
            out = R.ring_attention(*local, cp, attend_mask=starts, dropout=dropout, kernels=kernels)
            ran.append(out.grad_fn.kernels.kind)  # the kernel the ring chose
            return [out.detach(), *torch.autograd.grad(out, local, dout)]

        got = run(CUDA_KERNELS)
        blocks = len(stand.returned)
        replay = stand.masks[:blocks] * 2  # the textbook ring draws each block's mask in forward, then in backward
        R._keep_mask = lambda *args: replay.pop(0)
        want = run(PLAIN_KERNELS)
        paired = len(stand.given) == blocks and all(
            torch.equal(a, b) for r, s in zip(stand.returned, stand.given) for a, b in zip(r, s))
        error = max((a - b).abs().max().item() for a, b in zip(got, want))
        results.append((error, paired, ran[0], blocks, not replay or dropout == 0))
    return results


CASES = [("flash", 0.0, False), ("efficient", 0.0, True), ("flash", 0.3, False), ("efficient", 0.3, False)]


def test_the_cuda_blocks_equal_the_textbook_blocks_on_the_ring_dropout_included():
    """CP 2, GQA (4 query, 2 key heads): FlashAttention's and memory-efficient attention's blocks (CPU stand-ins)
    give the textbook blocks' outputs and q, k, v gradients, plain causal and with each rank's document starts
    (per-document sub-blocks); with dropout, given the same masks, and every block's backward receives the RNG
    state its forward returned (fails if a state is dropped, reordered or the last one reused, as torch's own
    ring does; if the efficient kernel's padded log-sum-exp is merged uncut: its padding is NaN here)."""
    for rank_results in run_distributed(_cuda_dispatch_body, 2, CASES):
        for (kind, dropout, documents), (error, paired, ran, blocks, masks_used) in zip(CASES, rank_results):
            assert ran == kind and error < 1e-5 and paired and masks_used, (kind, dropout, error, paired)
            assert blocks >= 2 if not documents else blocks > 2  # one state per block (or sub-block)


def test_the_cuda_wrappers_call_the_real_ops_as_their_schemas_say():
    """The four wrappers against the real ATen ops' meta kernels (argument order, optional tensors, outputs): the
    efficient kernel's log-sum-exp comes padded to 32 rows and is cut, and padded back for its backward; GQA keys go
    into FlashAttention unexpanded and into the efficient kernel expanded, their gradients per key head."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(2, 4, 40, 8, **meta), torch.empty(2, 2, 24, 8, **meta)
    for forward, backward in ((B.flash_forward, B.flash_backward), (B.efficient_forward, B.efficient_backward)):
        out, lse, state = forward(q, k, k, False, 0.35, 0.1)
        assert out.shape == q.shape and lse.shape == (2, 4, 40) and len(state) == 2
        dq, dk, dv = backward(out, q, k, k, out, lse, False, 0.35, 0.1, state)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape


def test_each_kernel_table_picks_its_block_kernel(monkeypatch):
    q, k = torch.zeros(1, 4, 8, 8), torch.zeros(1, 2, 8, 8)
    assert ring_block_kernel(CPU_KERNELS, q, k, 0.0, True) == "cpu_flash"
    assert ring_block_kernel(CPU_KERNELS, q, k, 0.1, False) == "math"  # SDPA's fused CPU kernel has no dropout
    assert ring_block_kernel(PLAIN_KERNELS, q, k, 0.0, False) == "math"
    assert not K.cuda_attention_fits("flash", q, k, 0.0)  # CPU tensors: torch's checks are never asked
    assert ring_block_kernel(CUDA_KERNELS, q, k, 0.0, False) == "math"
    fits = {"flash", "efficient"}
    monkeypatch.setattr(K, "cuda_attention_fits", lambda kind, *_: kind in fits)
    assert ring_block_kernel(CUDA_KERNELS, q, k, 0.1, False) == "flash"
    assert ring_block_kernel(CUDA_KERNELS, q, k, 0.1, True) == "math"  # a dense mask: the textbook blocks
    fits.discard("flash")  # fp32, or a head size FlashAttention does not take
    assert ring_block_kernel(CUDA_KERNELS, q, k, 0.1, False) == "efficient"
    assert CUDA_KERNELS.ring_blocks_fuse_dropout and not CPU_KERNELS.ring_blocks_fuse_dropout


@pytest.mark.parametrize("kind", ["math", "cpu_flash"])
def test_the_cpu_block_kernels_keep_no_rng_state(kind):
    kernels = B.BlockKernels(kind)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out, lse = kernels.forward(q, k, k, True, 0.35)
    kernels.start_backward()
    assert kernels.states == [] and len(kernels.backward(out, q, k, k, out, lse, True, 0.35)) == 3
    assert kernels.draws_masks == (kind == "math")
