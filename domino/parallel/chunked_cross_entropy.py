"""Output layer + vocabulary-parallel cross-entropy in row chunks: never the full ``[tokens, V/tp]`` fp32 logits.

The one-buffer fused loss of :mod:`domino.parallel.cross_entropy` keeps a ``[tokens, V/tp]`` fp32 softmax from
forward to backward (and, in 16-bit, the 16-bit logits beside it): 9.2 GiB at GPT-1.3B, micro-batch 16,
sequence 2048, TP=1. Megatron-LM's ``--cross-entropy-loss-fusion`` (``megatron/core/fusions/
fused_cross_entropy.py``) fuses the loss's elementwise passes over those logits into fewer kernels but still
materialises them. Here they never exist whole:

* forward runs the output GEMM one chunk of ``chunk_rows`` tokens at a time and makes one pass over each chunk's
  logits: the device's log-softmax row kernel, in place (:func:`_log_softmax_`). The loss is ``-log_softmax`` at
  the target, and the chunk's log-sum-exp, the one number per token kept for backward, is read back from the same
  column as ``z_j - log_softmax_j``. Over TP ranks each rank's log-sum-exp is merged into the global one by an
  all-reduced max and sum, and the target logit by an all-reduced sum, as in the unchunked loss;
* backward recomputes each chunk's logits from the saved ``hidden`` and ``weight`` (one more output-layer GEMM,
  about a third more output-layer FLOPs) shifted by the saved log-sum-exp, and makes one pass over them, ``exp``,
  for this rank's slice of the softmax; minus the one-hot (one element per token) it is ``d loss / d logits``. The
  per-token factor ``grad_loss`` multiplies the ``[chunk, h]`` operands in fp32, and in 16-bit multiplies in fp32
  with the cast (a loss scale applies before it, as in the unchunked loss); the input and weight gradients are
  accumulated chunk by chunk.

The textbook loss passes over the logits once per step of its formula (row max, subtract, ``exp``, sum in
forward; subtract, ``exp``, scale in backward). Here an fp32 chunk is passed over once each way besides its
GEMMs; a 16-bit one adds, in backward, the fp32 shift and the scaling cast, and on CPU its conversion to fp32 in
forward, which CUDA's kernel does as it reads. ``tests/parallel/test_parallel_chunked_cross_entropy.py`` counts
the passes with a dispatch mode.

The memory of the loss is then one chunk's ``[chunk_rows, V/tp]`` logits (fp32, plus its 16-bit GEMM output)
instead of all tokens'. The maths is the unchunked loss's, in another order of operations (the log-sum-exp
read back from the log-softmax, the weight gradient summed chunk by chunk): equal within fp32 rounding, which
``tests/parallel/test_parallel_chunked_cross_entropy.py`` checks at TP=1 and TP=2. Which devices chunk, and how
large the chunks are, is :mod:`domino.parallel.kernels`' choice (``loss_chunk_bytes``).
"""

from __future__ import annotations

import torch

from domino.parallel.collectives import SINGLE, MeshGroup, all_reduce_max_, all_reduce_sum_


def _chunks(rows: int, chunk_rows: int):
    for start in range(0, rows, chunk_rows):
        yield start, min(rows, start + chunk_rows)


def _log_softmax_(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``log_softmax(logits)`` in ``dtype`` by the device's fused row kernel: the one pass over a chunk in forward.

    The kernel finds each row's max, its sum of ``exp(z - max)`` and writes ``z - max - log(sum)`` row by row,
    reading every element before it writes it (``_vec_log_softmax_lastdim`` in ATen's
    ``native/cpu/SoftMaxKernel.cpp``; ``cunn_SoftMaxForward`` with its log epilogue in ``native/cuda/SoftMax.cu``),
    so fp32 logits are overwritten in place; 16-bit logits go to a new fp32 buffer (the kernel's ``half_to_float``
    on CUDA)."""
    if logits.dtype == dtype:
        return torch.ops.aten._log_softmax.out(logits, -1, False, out=logits)
    return torch.log_softmax(logits, dim=-1, dtype=dtype)


def _shifted_logits(chunk_hidden: torch.Tensor, weight: torch.Tensor, log_sum_exp: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T - log_sum_exp`` in fp32 (``log_sum_exp``'s dtype), whose ``exp`` is the softmax.

    fp32: one GEMM starting from ``-log_sum_exp`` (``addmm`` with the column broadcast as its input), so the shift
    costs no pass of its own. 16-bit: the GEMM in 16 bits, then one subtraction into fp32 (a 16-bit shift would
    round the log-sum-exp to 3 significant digits)."""
    shift = log_sum_exp.unsqueeze(-1)
    if weight.dtype == log_sum_exp.dtype:
        return torch.addmm(shift.neg(), chunk_hidden, weight.t())
    return torch.sub(torch.matmul(chunk_hidden, weight.t()), shift)


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
            logits = torch.matmul(flat_hidden[a:b], weight.t())  # [chunk, V/tp]
            local = flat_target[a:b] - start_vocab
            outside = (local < 0) | (local >= per_rank)
            column = local.masked_fill(outside, 0).unsqueeze(-1)  # the target's column, else any column (0)
            logit = logits.gather(-1, column).squeeze(-1).to(dtype)  # read before the kernel overwrites it
            log_prob = _log_softmax_(logits, dtype).gather(-1, column).squeeze(-1)
            if world == 1:  # -log p(target), as F.cross_entropy computes it
                loss[a:b] = log_prob.neg()
                log_sum_exp[a:b] = logit - log_prob
                continue
            # This rank's log-sum-exp read back from any column j: z_j - log_softmax_j (exact to the rounding of
            # |z_j - lse|); the ranks' ones merged as the unchunked loss merges its row maxima and sums.
            local_lse = logit - log_prob
            global_max = all_reduce_max_(local_lse.clone(), tp)
            sum_exp = all_reduce_sum_(torch.exp(local_lse - global_max), tp)
            log_sum_exp[a:b] = global_max + torch.log(sum_exp)
            loss[a:b] = log_sum_exp[a:b] - all_reduce_sum_(logit.masked_fill_(outside, 0.0), tp)
        ctx.save_for_backward(hidden, weight, target, log_sum_exp)
        ctx.chunk_rows, ctx.grad_slot, ctx.start_vocab = chunk_rows, grad_slot, start_vocab
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, target, log_sum_exp = ctx.saved_tensors
        per_rank = weight.shape[0]
        flat_hidden, flat_target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        flat_grad = grad_loss.reshape(-1).to(log_sum_exp.dtype)
        # fp32: the per-token factor multiplies the [chunk, h] operand and result instead of the [chunk, V/tp]
        # gradient (same products, no pass over the logits); 16-bit: it multiplies in fp32 before the cast, where a
        # loss scale keeps the small probabilities above fp16's smallest subnormal.
        scale_rows = weight.dtype == log_sum_exp.dtype
        grad_hidden = torch.empty_like(flat_hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=log_sum_exp.dtype, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        for a, b in _chunks(flat_target.numel(), ctx.chunk_rows):
            chunk_hidden, chunk_grad = flat_hidden[a:b], flat_grad[a:b].unsqueeze(-1)
            probs = _shifted_logits(chunk_hidden, weight, log_sum_exp[a:b]).exp_()  # this rank's softmax slice
            local = flat_target[a:b] - ctx.start_vocab
            inside = (local >= 0) & (local < per_rank)
            probs.scatter_add_(-1, local.clamp(0, per_rank - 1).unsqueeze(-1),
                               -inside.to(probs.dtype).unsqueeze(-1))  # minus the one-hot
            if scale_rows:
                grad_logits = probs
            else:  # scale and cast in one pass
                grad_logits = torch.mul(probs, chunk_grad, out=torch.empty_like(probs, dtype=weight.dtype))
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[a:b])
                if scale_rows:
                    grad_hidden[a:b].mul_(chunk_grad)
            if grad_weight is not None and scale_rows:
                grad_weight.addmm_(grad_logits.t(), chunk_hidden * chunk_grad)
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
