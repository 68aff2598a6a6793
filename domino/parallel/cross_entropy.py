"""Cross-entropy over logits that stay split along the vocabulary across TP ranks.

Gathering ``[b, s, V]`` logits on every rank would cost ``tp`` times the memory and an all-gather of the
largest activation in the model; instead each rank keeps its ``V / tp`` columns and three small all-reduces
over ``[b, s]`` tensors (max, target logit, sum of exponentials) give the exact loss. The computation is the
numerically stable ``log(sum(exp(z - max))) - (z_target - max)`` in fp32.

Memory: one fp32 ``[.., V/tp]`` buffer is allocated; it holds ``z - max``, then ``exp``, then the softmax
saved for backward, and backward turns it into the gradient in place (so ``retain_graph`` re-use of the
loss is not supported, as in Megatron-LM).
"""

from __future__ import annotations

import torch

from domino.parallel.collectives import all_reduce_max_, all_reduce_sum_, tp_rank_and_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        rank, world = tp_rank_and_size()
        per_rank = logits.shape[-1]
        start = rank * per_rank
        # One fp32 buffer: z - max (a new tensor even for fp32 input, so the caller's logits stay intact).
        z = logits.float()
        z = z - all_reduce_max_(z.max(dim=-1)[0]).unsqueeze(-1)

        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = torch.gather(z, -1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        all_reduce_sum_(target_logit)

        z.exp_()
        sum_exp = all_reduce_sum_(z.sum(dim=-1))
        loss = torch.log(sum_exp) - target_logit

        z.div_(sum_exp.unsqueeze(-1))  # now the softmax, kept for backward
        ctx.save_for_backward(z, local_target, outside)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d z = softmax - one_hot(target); built in place
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of vocab-split logits.

    Args:
        logits: ``[..., V / tp]`` this rank's vocabulary columns (rank ``r`` holds ``[r V/tp, (r+1) V/tp)``).
        target: ``[...]`` int64 token ids in ``[0, V)``.

    Returns:
        ``[...]`` fp32 losses, identical on every TP rank; equal to
        ``F.cross_entropy(full_logits, target, reduction="none")``.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} do not match")
    return _VocabParallelCrossEntropy.apply(logits, target)
