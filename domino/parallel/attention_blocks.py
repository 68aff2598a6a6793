"""One attention block of context parallelism: its output and log-sum-exp, and its gradients given the merged ones.

A ring block (:mod:`domino.parallel.ring_attention`) needs the log-sum-exp of its scores to merge with the others,
which ``F.scaled_dot_product_attention`` does not return; the ATen ops under it do. Four kernels, one chosen per
ring call by :func:`domino.parallel.kernels.ring_block_kernel` (``Kernels.ring_blocks``):

* ``math``: the textbook softmax, the reference (``DOMINO_KERNELS=plain``; CPUs with attention dropout; CUDA
  inputs the fused ops do not take, and dense masks on CUDA). It holds the block's ``[b, H, s, t]`` fp32 scores,
  takes any mask, and applies the dropout masks the ring draws (``keep``).
* ``cpu_flash``: SDPA's fused CPU kernel, ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward;
  no dropout (the op raises on it), takes an additive mask.
* ``flash`` (CUDA): ``aten._scaled_dot_product_flash_attention`` / ``_backward``: fp16 and bf16, grouped-query
  keys unexpanded (FlashAttention takes fewer key heads); no mask.
* ``efficient`` (CUDA): ``aten._scaled_dot_product_efficient_attention`` / ``_backward`` (memory-efficient
  attention): fp32 too; keys expanded to the query heads, gradients summed back; its log-sum-exp comes padded to a
  multiple of 32 rows (``meta__scaled_dot_product_efficient_attention`` in torch 2.13
  ``torch/_meta_registrations.py``): cut for the merge, padded again for the backward, which reads it so.

The CUDA ops' calling conventions are torch 2.13's (the schemas ``torch.ops.aten.<op>.default._schema``; their use
in torch's own ring, ``_scaled_dot_product_ring_flash_attention`` / ``_efficient_attention`` and their backward in
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``). Their dropout is the kernel's own
(philox, seeded from the current CUDA generator: the ring runs under the TP stream); each call returns its RNG state
(flash: ``rng_state, unused``; efficient: ``philox_seed, philox_offset``), which the backward must be given to drop
the same probabilities. Torch's ring keeps only the last block's state (its ``*rest``); here each call's state is
kept in call order (:class:`BlockKernels`) and handed back to the same block's backward.

**The CUDA kernels have not run on a GPU.** Their dispatch, RNG-state hand-back and GQA/padding handling are tested
on CPU with CPU stand-ins for the four ops (``tests/parallel/test_attention_blocks.py``), and their argument lists
against the ops' meta kernels; ``benchmarks/gpu_check.py``'s ``cp_2`` stage runs them on a GPU.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

Result = Tuple[torch.Tensor, torch.Tensor]

#: The efficient kernel's log-sum-exp is padded to a multiple of this many rows.
EFFICIENT_LSE_ROWS = 32


def _hidden(mask: Optional[torch.Tensor], causal: bool, s: int, t: int, device: torch.device
            ) -> Optional[torch.Tensor]:
    """Which scores of a block are hidden (True), broadcastable to ``[b, G, n, s, t]``: ``~mask`` of a
    ``[b or 1, 1, s, t]`` block of the attention mask, else the causal triangle, else none."""
    if mask is not None:
        return ~mask.unsqueeze(2)
    return torch.ones(s, t, dtype=torch.bool, device=device).triu(1) if causal else None


def math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 mask: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None, dropout: float = 0.0
                 ) -> Result:
    """Textbook attention of ``[b, H, s, d]`` queries over ``[b, G, t, d]`` keys/values (GQA: key head ``j`` serves
    query heads ``j n .. j n + n - 1``): ``(out [b, H, s, d], lse [b, H, s] fp32)``.

    ``mask`` (bool ``[b or 1, 1, s, t]``, True = may attend) replaces the causal triangle; a row it hides whole gets
    ``lse = -inf`` and a zero output, so the merge ignores it. ``keep`` (bool ``[b, H, s, t]``) is the block's
    dropout mask: the probabilities it keeps are scaled by ``1 / (1 - dropout)``, the log-sum-exp is the undropped
    one (what the merge and the backward need, as flash attention's)."""
    b, heads, s, d = q.shape
    groups, t = k.shape[1], k.shape[2]
    qg = q.float().reshape(b, groups, heads // groups, s, d)
    scores = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale  # [b, G, n, s, t]
    hidden = _hidden(mask, causal, s, t, q.device)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0).unsqueeze(-1))  # a wholly hidden row: all zeros
    if keep is not None:
        probs = probs * keep.reshape(probs.shape) / (1 - dropout)
    out = torch.matmul(probs, v.float().unsqueeze(2))
    return out.reshape(b, heads, s, d).to(q.dtype), lse.reshape(b, heads, s)


def math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float, mask: Optional[torch.Tensor] = None,
                  keep: Optional[torch.Tensor] = None, dropout: float = 0.0) -> Tuple[torch.Tensor, ...]:
    """Gradients of one block given the merged ``out`` and ``lse`` of the whole rows: ``(dq, dk, dv)`` in fp32.

    With dropout (``keep`` as in :func:`math_forward`) the rows' correction term is still ``sum(dout * out)`` of
    the dropped output: the kept probabilities' gradient is scaled as they were."""
    b, heads, s, d = q.shape
    groups, n = k.shape[1], heads // k.shape[1]

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return x.float().reshape(b, groups, n, *x.shape[2:])

    qg, dog, og, lg = grouped(q), grouped(dout), grouped(out), grouped(lse)
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    scores = torch.matmul(qg, kf.transpose(-1, -2)) * scale
    hidden = _hidden(mask, causal, s, k.shape[2], q.device)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.exp(scores - lg.unsqueeze(-1))  # the whole row's softmax, on this block's keys
    dprobs = torch.matmul(dog, vf.transpose(-1, -2))
    if keep is not None:
        kept = keep.reshape(probs.shape) / (1 - dropout)
        dv = torch.matmul((probs * kept).transpose(-1, -2), dog).sum(2)
        dprobs = dprobs * kept
    else:
        dv = torch.matmul(probs.transpose(-1, -2), dog).sum(2)
    dscores = probs * (dprobs - (dog * og).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(dscores, kf).reshape(b, heads, s, d)
    dk = torch.matmul(dscores.transpose(-1, -2), qg).sum(2)
    return dq, dk, dv


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, G, t, d]`` keys or values repeated to ``heads`` heads (itself without GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Each key head's gradient: the sum over the query heads it served (of an expanded ``[b, H, t, d]``)."""
    if grad.shape[1] == groups:
        return grad
    return grad.reshape(grad.shape[0], groups, grad.shape[1] // groups, *grad.shape[2:]).sum(2)


def _additive(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The fused CPU kernel takes a mask as scores to add, in the query's dtype."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def cpu_flash_forward(q, k, v, causal, scale, mask=None, keep=None, dropout=0.0) -> Result:
    """SDPA's fused CPU kernel (GQA keys expanded to the query heads). It has no dropout (``keep`` must be None),
    and gives a row a mask hides whole ``lse = 0``: set to ``-inf`` here, as the math kernel's, so that the merge
    ignores the row."""
    assert keep is None and dropout == 0, "SDPA's fused CPU kernel has no dropout: the ring picks the math blocks"
    heads = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, expand_heads(k, heads), expand_heads(v, heads), 0.0, causal and mask is None,
        attn_mask=_additive(mask, q.dtype), scale=scale)
    if mask is not None:
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None, keep=None, dropout=0.0):
    assert keep is None and dropout == 0, "SDPA's fused CPU kernel has no dropout: the ring picks the math blocks"
    heads, groups = q.shape[1], k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, expand_heads(k, heads), expand_heads(v, heads), out, lse, 0.0, causal and mask is None,
        attn_mask=_additive(mask, q.dtype), scale=scale)
    return dq.float(), _sum_groups(dk, groups).float(), _sum_groups(dv, groups).float()


def cuda_ops():
    """The four CUDA ops (flash forward and backward, efficient forward and backward); tests put CPU stand-ins
    here."""
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
            aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward)


def flash_forward(q, k, v, causal, scale, dropout=0.0):
    """``(out, lse, rng state)`` of FlashAttention on one block (schema: ``output, logsumexp, cum_seq_q, cum_seq_k,
    max_q, max_k, rng_state, unused, debug_attn_mask``)."""
    out, lse, _, _, _, _, seed, offset, _ = cuda_ops()[0](q, k, v, dropout, causal, False, scale=scale)
    return out, lse, (seed, offset)


def flash_backward(dout, q, k, v, out, lse, causal, scale, dropout, state):
    """FlashAttention's backward of one block given the merged ``out`` and ``lse`` and the block's RNG state; the
    key/value gradients come per key head (the kernel sums the query heads of a group)."""
    seed, offset = state
    return cuda_ops()[1](dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], dropout, causal,
                         seed, offset, scale=scale)


def efficient_forward(q, k, v, causal, scale, dropout=0.0):
    """``(out, lse, rng state)`` of memory-efficient attention on one block (keys expanded; the log-sum-exp's
    padding cut)."""
    heads = q.shape[1]
    out, lse, seed, offset = cuda_ops()[2](q, expand_heads(k, heads), expand_heads(v, heads), None, True, dropout,
                                           causal, scale=scale)
    return out, lse[:, :, :q.shape[2]], (seed, offset)


def efficient_backward(dout, q, k, v, out, lse, causal, scale, dropout, state):
    heads, groups, s = q.shape[1], k.shape[1], q.shape[2]
    padded = torch.nn.functional.pad(lse, (0, -s % EFFICIENT_LSE_ROWS))  # the row count the forward returned
    seed, offset = state
    dq, dk, dv, _ = cuda_ops()[3](dout, q, expand_heads(k, heads), expand_heads(v, heads), None, out, padded, seed,
                                  offset, dropout, [True, True, True, False], causal, scale=scale)
    return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)


_CUDA = {"flash": (flash_forward, flash_backward), "efficient": (efficient_forward, efficient_backward)}


class BlockKernels:
    """The block kernel of one ring call (``kind``: ``math``, ``cpu_flash``, ``flash`` or ``efficient``), forward
    and backward with the signatures of :func:`math_forward` / :func:`math_backward`.

    The CUDA kernels draw their own dropout: each forward call's RNG state is kept in call order, and backward,
    which visits the blocks (and their per-document sub-blocks) in the forward's order, hands each back to its
    block (:meth:`start_backward` rewinds). The math kernel takes the masks the ring draws (:attr:`draws_masks`)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.states: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._replay = iter(())

    @property
    def draws_masks(self) -> bool:
        """Whether the ring must draw this kernel's dropout masks (and replay them in backward)."""
        return self.kind == "math"

    def forward(self, q, k, v, causal, scale, mask=None, keep=None, dropout=0.0) -> Result:
        if self.kind == "math":
            return math_forward(q, k, v, causal, scale, mask, keep, dropout)
        if self.kind == "cpu_flash":
            return cpu_flash_forward(q, k, v, causal, scale, mask, keep, dropout)
        assert mask is None and keep is None, f"the {self.kind} blocks take no mask and draw their own dropout"
        out, lse, state = _CUDA[self.kind][0](q, k, v, causal, scale, dropout)
        self.states.append(state)  # for this block's backward: its dropout replayed
        return out, lse

    def start_backward(self) -> None:
        """The next :meth:`backward` is the first block's again."""
        self._replay = iter(self.states)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, keep=None, dropout=0.0):
        if self.kind == "math":
            return math_backward(dout, q, k, v, out, lse, causal, scale, mask, keep, dropout)
        if self.kind == "cpu_flash":
            return cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask, keep, dropout)
        state = next(self._replay)
        # The fused ops take the output in the inputs' dtype and return gradients in it: fp32 for the ring's sums.
        grads = _CUDA[self.kind][1](dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, causal, scale, dropout, state)
        return tuple(g.float() for g in grads)
