"""Output layer + vocabulary-parallel cross-entropy in row chunks: never the full ``[tokens, V/tp]`` fp32 logits.

The one-buffer fused loss of :mod:`domino.parallel.cross_entropy` keeps a ``[tokens, V/tp]`` fp32 softmax from
forward to backward (and, in 16-bit, the 16-bit logits beside it): 9.2 GiB at GPT-1.3B, micro-batch 16,
sequence 2048, TP=1. Megatron-LM's ``--cross-entropy-loss-fusion`` (``megatron/core/fusions/
fused_cross_entropy.py``) fuses the loss's elementwise passes over those logits into fewer kernels but still
materialises them. Here they never exist whole:

* forward runs the output GEMM one chunk of ``chunk_rows`` tokens at a time and keeps only each token's
  log-sum-exp (fp32, one number per token) after computing its loss: per chunk the row max, the sum of
  ``exp(z - max)`` and the target logit, each all-reduced over the TP group as in the unchunked loss;
* backward recomputes each chunk's logits from the saved ``hidden`` and ``weight`` (one more output-layer GEMM,
  about a third more output-layer FLOPs), turns them into ``(softmax - one_hot) * grad_loss`` in place (in fp32,
  so a 16-bit loss scale multiplies before the cast, as in the unchunked loss), and accumulates the input and
  weight gradients chunk by chunk.

The memory of the loss is then one chunk's ``[chunk_rows, V/tp]`` logits (fp32, plus its 16-bit GEMM output)
instead of all tokens'. The maths is the unchunked loss's, in another order of operations (log-sum-exp instead
of ``-log softmax``, the weight gradient summed chunk by chunk): equal within fp32 rounding, which
``tests/parallel/test_parallel_chunked_cross_entropy.py`` checks at TP=1 and TP=2. Which devices chunk, and how
large the chunks are, is :mod:`domino.parallel.kernels`' choice (``loss_chunk_bytes``).
"""

from __future__ import annotations

import torch

from domino.parallel.collectives import SINGLE, MeshGroup, all_reduce_max_, all_reduce_sum_


def _chunks(rows: int, chunk_rows: int):
    for start in range(0, rows, chunk_rows):
        yield start, min(rows, start + chunk_rows)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk_rows: int,
                tp: MeshGroup, grad_slot) -> torch.Tensor:
        rank, world = tp.rank, tp.size
        per_rank = weight.shape[0]
        start_vocab = rank * per_rank
        flat_hidden, flat_target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        rows = flat_target.numel()
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        loss = torch.empty(rows, dtype=dtype, device=hidden.device)
        log_sum_exp = torch.empty(rows, dtype=dtype, device=hidden.device)
        for a, b in _chunks(rows, chunk_rows):
            logits = torch.matmul(flat_hidden[a:b], weight.t()).to(dtype)  # [chunk, V/tp]
            local = flat_target[a:b] - start_vocab
            outside = (local < 0) | (local >= per_rank)
            local = local.masked_fill(outside, 0)
            target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill_(outside, 0.0)
            row_max = logits.amax(dim=-1)
            if world > 1:
                row_max = all_reduce_max_(row_max, tp)
                target_logit = all_reduce_sum_(target_logit, tp)
            sum_exp = logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)
            if world > 1:
                sum_exp = all_reduce_sum_(sum_exp, tp)
            log_sum_exp[a:b] = row_max + torch.log(sum_exp)
            loss[a:b] = log_sum_exp[a:b] - target_logit
        ctx.save_for_backward(hidden, weight, target, log_sum_exp)
        ctx.chunk_rows, ctx.grad_slot, ctx.start_vocab = chunk_rows, grad_slot, start_vocab
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, target, log_sum_exp = ctx.saved_tensors
        per_rank = weight.shape[0]
        flat_hidden, flat_target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        flat_grad = grad_loss.reshape(-1).to(log_sum_exp.dtype)
        grad_hidden = torch.empty_like(flat_hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=log_sum_exp.dtype, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        for a, b in _chunks(flat_target.numel(), ctx.chunk_rows):
            chunk_hidden = flat_hidden[a:b]
            probs = torch.matmul(chunk_hidden, weight.t()).to(log_sum_exp.dtype)
            probs.sub_(log_sum_exp[a:b].unsqueeze(-1)).exp_()  # this rank's slice of the global softmax
            local = flat_target[a:b] - ctx.start_vocab
            inside = (local >= 0) & (local < per_rank)
            probs.scatter_add_(-1, local.clamp(0, per_rank - 1).unsqueeze(-1),
                               -inside.to(probs.dtype).unsqueeze(-1))  # minus the one-hot
            probs.mul_(flat_grad[a:b].unsqueeze(-1))  # in fp32: a 16-bit loss scale applies before the cast
            grad_logits = probs.to(weight.dtype)
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[a:b])
            if grad_weight is not None and grad_logits.dtype == grad_weight.dtype:
                grad_weight.addmm_(grad_logits.t(), chunk_hidden)
            elif grad_weight is not None:  # a 16-bit GEMM (fp32 accumulation inside), summed over chunks in fp32
                grad_weight.add_(grad_logits.t().matmul(chunk_hidden))
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(hidden.shape)
            if ctx.grad_slot is not None:
                # Async launch: the input gradient's TP all-reduce starts now; the slot's owner (Domino's guard
                # after the final norm) waits for it before the gradient is read.
                ctx.grad_slot.launch(grad_hidden)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                 chunk_rows: int, tp: MeshGroup = SINGLE, grad_slot=None) -> torch.Tensor:
    """Per-token ``cross_entropy(hidden @ weight.T, target)`` over vocabulary-split weights, ``chunk_rows`` tokens
    of logits at a time (see the module doc); the arguments and result are those of
    :func:`domino.parallel.cross_entropy.vocab_parallel_linear_cross_entropy`."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, target, chunk_rows, tp, grad_slot)
