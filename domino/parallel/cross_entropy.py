"""Cross-entropy over logits that stay split along the vocabulary across TP ranks.

Gathering ``[b, s, V]`` logits on every rank would cost ``tp`` times the memory and an all-gather of the
largest activation in the model; instead each rank keeps its ``V / tp`` columns, and all-reduces over
``[b, s]`` tensors give the exact, numerically stable loss ``logsumexp(z) - z_target``:

* each rank takes its local softmax ``p_r`` with PyTorch's fused row kernel (stable by construction) and
  reads its local ``sum_j exp(z_j - max_r)`` back as ``1 / max(p_r)`` (the max entry of a softmax is
  ``exp(0) / sum``), so no full-size temporary is needed for it;
* ``max`` and the rescaled sums are all-reduced into the global log-sum-exp, and ``p_r`` is rescaled in place
  into this rank's slice of the global softmax.

With a single rank (TP=1) on CPU the loss is read from the softmax as ``-log(p_target)``: no pass over the
logits besides the softmax kernel, with a fallback to ``logsumexp`` for the rare rows where ``p_target`` is too
small for fp32 to hold exactly (deciding whether any row needs it reads one value on the host). On CUDA, where
that read would drain the GPU's queue, TP=1 takes the TP>1 formula instead (:mod:`domino.parallel.kernels`).

Memory and speed: one fp32 ``[.., V/tp]`` buffer holds the softmax saved for backward, and backward turns it
into the gradient in place (so re-using the loss with ``retain_graph`` is not supported, as in Megatron-LM).
:func:`vocab_parallel_linear_cross_entropy` also computes the logits itself, so for fp32 the softmax
overwrites them and the logits' buffer is the only logits-sized allocation of the whole loss; once backward is
done with it, that buffer is kept for the next step in the caller's :class:`LogitsBuffer` (the model's), where it
gives one. Backward applies the upstream per-token gradient to the ``[.., h]`` operands of its two GEMMs rather
than to the ``[.., V/tp]`` gradient.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from domino.parallel.chunked_cross_entropy import chunked_linear_cross_entropy
from domino.parallel.collectives import SINGLE, MeshGroup, all_reduce_max_, all_reduce_sum_
from domino.parallel.kernels import Kernels, resolve


# A target probability at or above this is a normal fp32 number: -log(p) is then exact to a few ulps.
_SMALLEST_TRUSTED_PROBABILITY = 1e-30


def _softmax_and_loss(logits: torch.Tensor, target: torch.Tensor, in_place: bool,
                      logits_of_rows: Callable[[torch.Tensor], torch.Tensor], tp: MeshGroup, kernels: Kernels):
    """Global softmax slice (fp32), per-token loss, and what backward needs to subtract the one-hot.

    With ``in_place`` (logits already fp32 or wider) the softmax overwrites ``logits``: no second buffer.
    ``logits_of_rows(mask)`` returns the logits of the rows selected by a boolean ``mask`` over ``target``
    (needed, rarely, after the softmax has overwritten them).
    """
    rank, world = tp.rank, tp.size
    dtype = torch.promote_types(logits.dtype, torch.float32)
    in_place = in_place and logits.dtype == dtype
    per_rank = logits.shape[-1]
    start = rank * per_rank
    outside = (target < start) | (target >= start + per_rank)
    local_target = (target - start).masked_fill(outside, 0)
    if world == 1 and kernels.loss_from_softmax:
        probs = _softmax(logits, in_place, dtype)
        return probs, _loss_from_softmax(probs, target, logits_of_rows, dtype), local_target, outside
    # Read what is needed from the logits before the softmax may overwrite them.
    target_logit = torch.gather(logits, -1, local_target.unsqueeze(-1)).squeeze(-1).to(dtype)
    target_logit.masked_fill_(outside, 0.0)
    local_max = logits.amax(dim=-1).to(dtype)
    probs = _softmax(logits, in_place, dtype)
    local_sum = probs.amax(dim=-1).reciprocal_()  # sum_j exp(z_j - local_max)
    if world == 1:  # the softmax is already the global one
        return probs, local_max + torch.log(local_sum) - target_logit, local_target, outside
    global_max = all_reduce_max_(local_max.clone(), tp)
    rescaled = local_sum * torch.exp(local_max - global_max)
    global_sum = all_reduce_sum_(rescaled.clone(), tp)
    probs.mul_((rescaled / global_sum).unsqueeze(-1))  # local softmax -> slice of the global one
    log_sum_exp = global_max + torch.log(global_sum)
    loss = log_sum_exp - all_reduce_sum_(target_logit, tp)
    return probs, loss, local_target, outside


def _softmax(logits: torch.Tensor, in_place: bool, dtype: torch.dtype) -> torch.Tensor:
    if in_place:
        # The row-wise softmax kernel reads each element before writing it: aliasing input and output is safe.
        return torch.ops.aten._softmax.out(logits, -1, False, out=logits)
    return torch.softmax(logits, dim=-1, dtype=dtype)


def _loss_from_softmax(probs: torch.Tensor, target: torch.Tensor,
                       logits_of_rows: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``-log(softmax[target])`` when one rank holds the whole vocabulary.

    This needs no pass over the logits besides the softmax itself (no row max, no log-sum-exp), and it is as
    exact as ``logsumexp(z) - z_target`` while the target's probability is a normal fp32 number. Rows where it
    is not (a loss above ~69) get ``logsumexp(z) - z_target`` from their logits instead.
    """
    target_prob = torch.gather(probs, -1, target.unsqueeze(-1)).squeeze(-1)
    loss = target_prob.log().neg_()
    rare = target_prob < _SMALLEST_TRUSTED_PROBABILITY
    if rare.any():  # one host sync per loss; only these rows are recomputed
        logits = logits_of_rows(rare).to(dtype)
        loss[rare] = torch.logsumexp(logits, dim=-1) - logits.gather(-1, target[rare].unsqueeze(-1)).squeeze(-1)
    return loss


def _softmax_minus_one_hot_(probs, local_target, outside) -> torch.Tensor:
    """Turns the saved softmax into ``softmax - one_hot`` (``d loss / d logits`` per unit loss), in place."""
    return probs.scatter_add_(-1, local_target.unsqueeze(-1), (outside.to(probs.dtype) - 1.0).unsqueeze(-1))


def _softmax_to_grad_(probs, local_target, outside, grad_loss) -> torch.Tensor:
    """Turns the saved softmax into ``d loss / d logits = (softmax - one_hot) * grad_loss``, in place."""
    return _softmax_minus_one_hot_(probs, local_target, outside).mul_(grad_loss.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp: MeshGroup, kernels: Kernels) -> torch.Tensor:
        probs, loss, local_target, outside = _softmax_and_loss(logits, target, in_place=False,
                                                               logits_of_rows=lambda rows: logits[rows], tp=tp,
                                                               kernels=kernels)
        ctx.save_for_backward(probs, local_target, outside)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        probs, local_target, outside = ctx.saved_tensors
        return _softmax_to_grad_(probs, local_target, outside, grad_loss).to(ctx.input_dtype), None, None, None


class LogitsBuffer:
    """Keeps the last released logits-sized buffer of the fused loss for the next step's forward.

    The fused loss needs one ``[tokens, V/tp]`` buffer per step. On CPU a fresh allocation of that size is
    mapped from the OS (and zero-filled page by page) every step, which costs about a tenth of the output
    layer's GEMM; re-using the buffer avoids it (on CUDA, where the caching allocator already does the same, none
    is kept: :mod:`domino.parallel.kernels`). The model owns one (``GPTModel.logits_buffer``) and passes it to
    each loss, so two models never share one. A buffer is lent to one forward at a time and only comes back once
    its backward has finished with it, so two graphs alive at once (several micro-batches, an evaluation loss
    with grad enabled) each get their own.

    A copy of the owner (``copy.deepcopy``, pickling) gets an empty buffer: what is kept is scratch memory.
    """

    def __init__(self) -> None:
        self._free: Optional[torch.Tensor] = None
        self._lock = threading.Lock()

    def take(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``shape`` (uninitialised): the kept one when it matches, else a new one."""
        with self._lock:
            buf, self._free = self._free, None
        if buf is not None and buf.shape == shape and buf.dtype == dtype and buf.device == device:
            return buf
        return torch.empty(shape, dtype=dtype, device=device)

    def give_back(self, buf: torch.Tensor) -> None:
        """Keeps ``buf`` for the next :meth:`take`; the caller must not read or write it afterwards."""
        with self._lock:
            self._free = buf

    def __deepcopy__(self, memo) -> "LogitsBuffer":
        return LogitsBuffer()

    def __reduce__(self):
        return LogitsBuffer, ()


class _LinearVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                graph: bool, grad_slot, tp: MeshGroup, kernels: Kernels,
                buffer: Optional[LogitsBuffer]) -> torch.Tensor:
        # F.linear without bias is matmul(hidden, weight.t()); same GEMM, written into a re-used buffer.
        shape = (*hidden.shape[:-1], weight.shape[0])
        out = (buffer.take(shape, hidden.dtype, hidden.device) if buffer is not None
               else torch.empty(shape, dtype=hidden.dtype, device=hidden.device))
        logits = torch.matmul(hidden, weight.t(), out=out)
        probs, loss, local_target, outside = _softmax_and_loss(
            logits, target, in_place=True, logits_of_rows=lambda rows: torch.matmul(hidden[rows], weight.t()),
            tp=tp, kernels=kernels)
        ctx.save_for_backward(hidden, weight, probs, local_target, outside)
        # The buffer to give the logits' memory back to once backward is done with it (None: released).
        ctx.buffer = buffer if probs is logits and graph else None
        if buffer is not None and ctx.buffer is None:
            # No backward will come, or (lower precision) the softmax has its own buffer.
            buffer.give_back(logits)
        ctx.backward_done = False
        ctx.grad_slot = grad_slot
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.backward_done:  # the softmax was turned into the gradient in place and then released
            raise RuntimeError("backward through the fused output layer + cross-entropy can only run once "
                               "(retain_graph is not supported)")
        ctx.backward_done = True
        hidden, weight, probs, local_target, outside = ctx.saved_tensors
        # d loss / d logits = (softmax - one_hot) * grad_loss.
        if probs.dtype == weight.dtype:
            # fp32: the per-token factor grad_loss is applied to the [tokens, h] operands and results instead of
            # the [tokens, V/tp] gradient (same products, one pass less).
            grad_logits = _softmax_minus_one_hot_(probs, local_target, outside)
            scale = grad_loss.unsqueeze(-1).to(weight.dtype)
        else:
            # fp16/bf16: grad_loss carries the loss scale; it must multiply the fp32 (softmax - one_hot) before the
            # cast, or the many probabilities below fp16's smallest subnormal (6e-8) would be flushed to zero.
            grad_logits = _softmax_to_grad_(probs, local_target, outside, grad_loss.to(probs.dtype)).to(weight.dtype)
            scale = None
        grad_hidden = grad_logits.matmul(weight) if ctx.needs_input_grad[0] else None
        if grad_hidden is not None and scale is not None:
            grad_hidden.mul_(scale)
        if ctx.grad_slot is not None and grad_hidden is not None:
            # Async launch: the input-gradient all-reduce runs during the weight-gradient GEMM below; the
            # slot's owner (Domino's guard after the final LayerNorm) waits for it before the gradient is read.
            ctx.grad_slot.launch(grad_hidden)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            scaled_hidden = (hidden * scale if scale is not None else hidden).reshape(-1, weight.shape[1])
            grad_weight = grad_logits.reshape(-1, weight.shape[0]).t().matmul(scaled_hidden)
        if ctx.buffer is not None:
            ctx.buffer.give_back(probs)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _check_shapes(logits_shape, target: torch.Tensor) -> None:
    if tuple(logits_shape[:-1]) != tuple(target.shape):
        raise ValueError(f"logits {tuple(logits_shape)} and target {tuple(target.shape)} do not match")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: MeshGroup = SINGLE,
                                 kernels: Optional[Kernels] = None) -> torch.Tensor:
    """Per-token cross-entropy of vocab-split logits.

    Args:
        logits: ``[..., V / tp]`` this rank's vocabulary columns (rank ``r`` holds ``[r V/tp, (r+1) V/tp)``).
        target: ``[...]`` int64 token ids in ``[0, V)``.
        tp: the tensor-parallel group the vocabulary is split over (one process by default).
        kernels: the loss's kernel choice (the model's, given by ``parallelize``); None: the device's.

    Returns:
        ``[...]`` losses in fp32 (fp64 for fp64 logits), identical on every TP rank; equal to
        ``F.cross_entropy(full_logits, target, reduction="none")``.
    """
    _check_shapes(logits.shape, target)
    return _VocabParallelCrossEntropy.apply(logits, target, tp, resolve(kernels, logits.device))


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                        target: torch.Tensor, tp: MeshGroup = SINGLE,
                                        grad_slot=None, kernels: Optional[Kernels] = None,
                                        buffer: Optional[LogitsBuffer] = None) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(F.linear(hidden, weight), target)`` with one logits-sized buffer.

    The logits never leave the function, so their buffer becomes the softmax and then the gradient in place
    (fp32 and wider; lower precisions keep one extra fp32 buffer). The input's gradient is *not* all-reduced: pass
    ``hidden`` through ``copy_to_tp_region`` first, as for any column-parallel product, or give a ``grad_slot``.

    Args:
        hidden: ``[..., h]`` activations (full on every TP rank).
        weight: ``[V / tp, h]`` this rank's vocabulary rows of the output layer.
        target: ``[...]`` int64 token ids in ``[0, V)``.
        tp: the tensor-parallel group the vocabulary is split over (one process by default).
        grad_slot: None, or an object whose ``launch(grad)`` starts the TP all-reduce of ``hidden``'s gradient
            (Domino's gradient guard): backward then launches it before computing the weight's gradient.
        kernels: the loss's kernel choice (the model's, given by ``parallelize``); None: the device's.
        buffer: where the logits' memory is taken from and, once backward is done with it, given back to for the
            next call (the model's :class:`LogitsBuffer`, kept where its kernels keep one: CPU); None allocates a
            fresh buffer and releases it.
    """
    _check_shapes((*hidden.shape[:-1], weight.shape[0]), target)
    kernels = resolve(kernels, hidden.device)
    graph = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    chunk_bytes = kernels.loss_chunk_bytes
    if chunk_bytes is not None and graph:
        chunk_rows = max(1, chunk_bytes // (4 * weight.shape[0]))  # fp32 logits of chunk_rows tokens
        if chunk_rows < target.numel():
            return chunked_linear_cross_entropy(hidden, weight, target, chunk_rows, tp, grad_slot)
    return _LinearVocabParallelCrossEntropy.apply(hidden, weight, target, graph, grad_slot, tp, kernels, buffer)
