"""Vocab-parallel cross-entropy equals F.cross_entropy, on one process and with logits split over 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed_helpers import run_distributed
from domino.runtime import state
from domino.parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy


def _inputs(scale: float = 1.0):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 16, generator=g) * scale
    target = torch.randint(0, 16, (3, 5), generator=g)
    upstream = torch.rand(3, 5, generator=g)
    return logits, target, upstream


def _reference(logits, target, upstream):
    x = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1), reduction="none").reshape(target.shape)
    loss.backward(upstream)
    return loss.detach(), x.grad


def test_single_process_matches_f_cross_entropy():
    logits, target, upstream = _inputs()
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target)
    loss.backward(upstream)
    ref_loss, ref_grad = _reference(logits, target, upstream)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(x.detach(), logits)  # the caller's logits are not modified


def test_numerically_stable_for_huge_logits():
    logits, target, _ = _inputs(scale=1e4)
    loss = vocab_parallel_cross_entropy(logits, target)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, _reference(logits, target, torch.ones(3, 5))[0], rtol=1e-5, atol=1e-2)


def test_bf16_logits_give_fp32_loss_and_bf16_grad():
    logits, target, _ = _inputs()
    x = logits.to(torch.bfloat16).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def _linear_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 5, 8, generator=g), torch.randn(16, 8, generator=g)


def _linear_reference(hidden, weight, target, upstream):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1), reduction="none").reshape(target.shape)
    loss.backward(upstream)
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_linear_matches_linear_then_f_cross_entropy(dtype):
    _, target, upstream = _inputs()
    hidden, weight = (t.to(dtype) for t in _linear_inputs())
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = vocab_parallel_linear_cross_entropy(h, w, target)
    loss.backward(upstream.to(loss.dtype))
    ref_loss, ref_h, ref_w = _linear_reference(hidden, weight, target, upstream.to(dtype))
    torch.testing.assert_close(loss.to(dtype), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-6, atol=1e-6)


def test_fused_loss_of_hopeless_rows_falls_back_to_log_sum_exp():
    """At TP=1 the loss is -log(p_target); rows whose p_target underflows fp32 are recomputed from logits."""
    _, target, upstream = _inputs()
    hidden, weight = _linear_inputs()
    hidden[0] *= 400.0  # losses of hundreds to thousands: p_target is 0 in fp32
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = vocab_parallel_linear_cross_entropy(h, w, target)
    loss.backward(upstream)
    ref_loss, ref_h, ref_w = _linear_reference(hidden.double(), weight.double(), target, upstream.double())
    assert loss[0].min() > 100 and loss[1:].max() < 30  # both kinds of rows are present
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(h.grad.double(), ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), ref_w, rtol=1e-5, atol=1e-5)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"logits \(3, 5, 16\) and target \(3, 4\) do not match"):
        vocab_parallel_cross_entropy(torch.zeros(3, 5, 16), torch.zeros(3, 4, dtype=torch.long))


def _body(rank, world_size):
    tp = state.initialize_model_parallel(2).tp
    logits, target, upstream = _inputs()
    x = logits[..., 8 * rank:8 * rank + 8].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, tp)
    loss.backward(upstream)
    hidden, weight = _linear_inputs()
    h, w = hidden.clone().requires_grad_(True), weight[8 * rank:8 * rank + 8].clone().requires_grad_(True)
    fused = vocab_parallel_linear_cross_entropy(h, w, target, tp)
    fused.backward(upstream)  # h's gradient is this rank's partial: copy_to_tp_region would sum them
    return loss.detach(), x.grad, fused.detach(), h.grad, w.grad


def test_two_ranks_match_f_cross_entropy():
    logits, target, upstream = _inputs()
    ref_loss, ref_grad = _reference(logits, target, upstream)
    results = run_distributed(_body, 2)
    hidden, weight = _linear_inputs()
    lin_loss, lin_h, lin_w = _linear_reference(hidden, weight, target, upstream)
    for rank, (loss, grad, fused, _, w_grad) in enumerate(results):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad[..., 8 * rank:8 * rank + 8], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused, lin_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w_grad, lin_w[8 * rank:8 * rank + 8], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][3] + results[1][3], lin_h, rtol=1e-6, atol=1e-6)


# Logits of order 1e4: exp() overflows without the max subtraction, and a max taken over one rank's slice
# only is wrong for every row whose largest logit lives on another rank.
SCALE_VOCAB, SCALE_DTYPES = 32, (torch.float32, torch.float16, torch.bfloat16)


def _large_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 6, SCALE_VOCAB, generator=g) * 1e4).to(dtype)
    target = torch.randint(0, SCALE_VOCAB, (2, 6), generator=g)
    upstream = torch.rand(2, 6, generator=g)
    hidden = torch.randn(2, 6, 8, generator=g).to(dtype) * 100
    weight = torch.randn(SCALE_VOCAB, 8, generator=g).to(dtype) * 30  # logits ~ 100 * 30 * sqrt(8): ~1e4
    return logits, target, upstream, hidden, weight


def _large_body(rank, world_size):
    tp = state.initialize_model_parallel(world_size).tp
    per_rank = SCALE_VOCAB // world_size
    mine = slice(per_rank * rank, per_rank * (rank + 1))
    out = {}
    for dtype in SCALE_DTYPES:
        logits, target, upstream, hidden, weight = _large_inputs(dtype)
        x = logits[..., mine].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x, target, tp)
        loss.backward(upstream)
        fused = None
        if dtype == torch.float32:  # half-precision logits of 1e4 are rounded by tens: no exact reference
            fused = vocab_parallel_linear_cross_entropy(hidden.clone(), weight[mine].clone(), target, tp).detach()
        out[str(dtype)] = (loss.detach(), x.grad.float(), fused)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_huge_logits_split_over_ranks_match_f_cross_entropy_on_the_gathered_logits(world_size):
    results = run_distributed(_large_body, world_size)
    per_rank = SCALE_VOCAB // world_size
    for dtype in SCALE_DTYPES:
        logits, target, upstream, hidden, weight = _large_inputs(dtype)
        ref_loss, ref_grad = _reference(logits.float(), target, upstream)
        fused_ref = F.cross_entropy(F.linear(hidden.double(), weight.double()).reshape(-1, SCALE_VOCAB),
                                    target.reshape(-1), reduction="none").reshape(target.shape)
        assert fused_ref.max() > 1e3
        assert ref_loss.max() > 1e3  # the regime where a missing global max shows
        for rank, result in enumerate(results):
            loss, grad, fused = result[str(dtype)]
            assert torch.isfinite(loss).all(), (dtype, rank)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-2, msg=f"{dtype} rank {rank}")
            torch.testing.assert_close(grad, ref_grad[..., per_rank * rank:per_rank * (rank + 1)],
                                       rtol=1e-2, atol=1e-2, msg=f"{dtype} rank {rank} grad")
            if fused is not None:
                torch.testing.assert_close(fused.double(), fused_ref, rtol=1e-5, atol=1e-1, msg=f"rank {rank} fused")


def test_fp16_loss_scale_multiplies_the_fp32_gradient_before_the_cast():
    """With fp16 loss scaling, grad_loss carries the scale (2**16 / tokens here). Probabilities of ~1e-9 are below
    fp16's smallest subnormal (6e-8): cast first, whole rows of the weight gradient vanish; scaled first (in fp32),
    every row the scale brings into fp16's normal range is exact to 1%."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 16, generator=g).half()
    weight = (torch.randn(64, 16, generator=g) * 3).half()  # logits of std ~12: most probabilities are tiny
    target = torch.randint(0, 8, (4,), generator=g)  # rows 8.. are never a target: only the softmax reaches them
    upstream = torch.full((4,), 2.0**16 / 4)
    _, ref_w = _linear_reference_fp32(hidden, weight, target, upstream)
    # Vocabulary rows that are never a target and whose scaled gradient is a normal fp16 number (>= 2**-14):
    # the loss scale is meant to carry them; rows smaller even after scaling are lost in any order.
    rows = torch.arange(64)[(torch.arange(64) >= 8) & (ref_w.abs().amax(dim=-1) >= 2.0**-14)]
    assert len(rows) >= 20

    w = weight.clone().requires_grad_(True)
    loss = vocab_parallel_linear_cross_entropy(hidden, w, target)
    loss.backward(upstream)
    assert w.grad.dtype == torch.float16
    error = (w.grad.float() - ref_w)[rows].norm(dim=-1) / ref_w[rows].norm(dim=-1)  # per row, relative
    assert error.max() < 0.01, error.max()

    # The order this replaces: (softmax - one_hot) cast to fp16 first, the scale applied to the hidden operand.
    probs = torch.softmax(F.linear(hidden, weight).float(), dim=-1)
    cast_first = (probs - F.one_hot(target, 64)).half()
    old_w = cast_first.t().matmul(hidden * upstream.unsqueeze(-1).half())
    old_error = (old_w.float() - ref_w)[rows].norm(dim=-1) / ref_w[rows].norm(dim=-1)
    lost = int((old_error > 0.5).sum())
    assert lost >= 5, f"cast first lost only {lost} of {len(rows)} rows"  # 8 rows come out exactly zero


def _linear_reference_fp32(hidden, weight, target, upstream):
    """fp32 gradients of the cross entropy of the same (fp16-computed) logits: only backward's precision differs."""
    probs = torch.softmax(F.linear(hidden, weight).float(), dim=-1)
    grad_logits = (probs - F.one_hot(target, weight.shape[0])) * upstream.unsqueeze(-1)
    return grad_logits.matmul(weight.float()), grad_logits.t().matmul(hidden.float())
