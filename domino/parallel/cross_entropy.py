"""Cross-entropy over logits that stay split along the vocabulary across TP ranks.

Gathering ``[b, s, V]`` logits on every rank would cost ``tp`` times the memory and an all-gather of the
largest activation in the model; instead each rank keeps its ``V / tp`` columns, and all-reduces over
``[b, s]`` tensors give the exact, numerically stable loss ``logsumexp(z) - z_target``:

* each rank takes its local softmax ``p_r`` with PyTorch's fused row kernel (stable by construction) and
  reads its local ``sum_j exp(z_j - max_r)`` back as ``1 / max(p_r)`` (the max entry of a softmax is
  ``exp(0) / sum``), so no full-size temporary is needed for it;
* ``max`` and the rescaled sums are all-reduced into the global log-sum-exp, and ``p_r`` is rescaled in place
  into this rank's slice of the global softmax.

Memory and speed: one fp32 ``[.., V/tp]`` buffer holds the softmax saved for backward, and backward turns it
into the gradient in place (so re-using the loss with ``retain_graph`` is not supported, as in Megatron-LM).
:func:`vocab_parallel_linear_cross_entropy` also computes the logits itself, so for fp32 the softmax
overwrites them and the logits' buffer is the only logits-sized allocation of the whole loss.
"""

from __future__ import annotations

import torch

from domino.parallel.collectives import all_reduce_max_, all_reduce_sum_, tp_rank_and_size


def _softmax_and_loss(logits: torch.Tensor, target: torch.Tensor, in_place: bool):
    """Global softmax slice (fp32), per-token loss, and what backward needs to subtract the one-hot.

    With ``in_place`` (logits already fp32 or wider) the softmax overwrites ``logits``: no second buffer.
    """
    rank, world = tp_rank_and_size()
    dtype = torch.promote_types(logits.dtype, torch.float32)
    in_place = in_place and logits.dtype == dtype
    per_rank = logits.shape[-1]
    start = rank * per_rank
    outside = (target < start) | (target >= start + per_rank)
    local_target = (target - start).masked_fill(outside, 0)
    # Read what is needed from the logits before the softmax may overwrite them.
    target_logit = torch.gather(logits, -1, local_target.unsqueeze(-1)).squeeze(-1).to(dtype)
    target_logit.masked_fill_(outside, 0.0)
    local_max = logits.amax(dim=-1).to(dtype)
    if in_place:
        # The row-wise softmax kernel reads each element before writing it: aliasing input and output is safe.
        probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=dtype)
    local_sum = probs.amax(dim=-1).reciprocal_()  # sum_j exp(z_j - local_max)
    if world > 1:
        global_max = all_reduce_max_(local_max.clone())
        rescaled = local_sum * torch.exp(local_max - global_max)
        global_sum = all_reduce_sum_(rescaled.clone())
        probs.mul_((rescaled / global_sum).unsqueeze(-1))  # local softmax -> slice of the global one
        log_sum_exp = global_max + torch.log(global_sum)
    else:
        log_sum_exp = local_max + torch.log(local_sum)
    loss = log_sum_exp - all_reduce_sum_(target_logit)
    return probs, loss, local_target, outside


def _softmax_to_grad_(probs, local_target, outside, grad_loss) -> torch.Tensor:
    """Turns the saved softmax into ``d loss / d logits = (softmax - one_hot) * grad_loss``, in place."""
    probs.scatter_add_(-1, local_target.unsqueeze(-1), (outside.to(probs.dtype) - 1.0).unsqueeze(-1))
    return probs.mul_(grad_loss.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        probs, loss, local_target, outside = _softmax_and_loss(logits, target, in_place=False)
        ctx.save_for_backward(probs, local_target, outside)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        probs, local_target, outside = ctx.saved_tensors
        return _softmax_to_grad_(probs, local_target, outside, grad_loss).to(ctx.input_dtype), None


class _LinearVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden, weight)  # never leaves this function
        probs, loss, local_target, outside = _softmax_and_loss(logits, target, in_place=True)
        ctx.save_for_backward(hidden, weight, probs, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, probs, local_target, outside = ctx.saved_tensors
        grad_logits = _softmax_to_grad_(probs, local_target, outside, grad_loss).to(weight.dtype)
        grad_hidden = grad_logits.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_logits.reshape(-1, weight.shape[0]).t().matmul(hidden.reshape(-1, weight.shape[1]))
        return grad_hidden, grad_weight, None


def _check_shapes(logits_shape, target: torch.Tensor) -> None:
    if tuple(logits_shape[:-1]) != tuple(target.shape):
        raise ValueError(f"logits {tuple(logits_shape)} and target {tuple(target.shape)} do not match")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of vocab-split logits.

    Args:
        logits: ``[..., V / tp]`` this rank's vocabulary columns (rank ``r`` holds ``[r V/tp, (r+1) V/tp)``).
        target: ``[...]`` int64 token ids in ``[0, V)``.

    Returns:
        ``[...]`` losses in fp32 (fp64 for fp64 logits), identical on every TP rank; equal to
        ``F.cross_entropy(full_logits, target, reduction="none")``.
    """
    _check_shapes(logits.shape, target)
    return _VocabParallelCrossEntropy.apply(logits, target)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                        target: torch.Tensor) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(F.linear(hidden, weight), target)`` with one logits-sized buffer.

    The logits never leave the function, so their buffer becomes the softmax and then the gradient in place
    (fp32 and wider; lower precisions keep one extra fp32 buffer). The input's gradient is *not* all-reduced: pass
    ``hidden`` through ``copy_to_tp_region`` first, as for any column-parallel product.

    Args:
        hidden: ``[..., h]`` activations (full on every TP rank).
        weight: ``[V / tp, h]`` this rank's vocabulary rows of the output layer.
        target: ``[...]`` int64 token ids in ``[0, V)``.
    """
    _check_shapes((*hidden.shape[:-1], weight.shape[0]), target)
    return _LinearVocabParallelCrossEntropy.apply(hidden, weight, target)
