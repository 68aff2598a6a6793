"""The fused output layer + cross-entropy re-uses its logits buffer across steps, never while it is in use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domino.parallel.cross_entropy import LogitsBuffer, vocab_parallel_linear_cross_entropy


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(16, 8, generator=g, requires_grad=True)
    return hidden, weight, torch.randint(0, 16, (2, 5), generator=g)


def _reference(hidden, weight, target):
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(F.linear(h, w).reshape(-1, 16), target.reshape(-1), reduction="none")
    loss.sum().backward()
    return loss.reshape(target.shape).detach(), h.grad, w.grad


@pytest.fixture
def fresh_buffer():
    return LogitsBuffer()


def _loss(hidden, weight, target, buffer):
    return vocab_parallel_linear_cross_entropy(hidden, weight, target, buffer=buffer)


def test_buffer_comes_back_after_backward_and_is_reused(fresh_buffer):
    hidden, weight, target = _inputs(0)
    _loss(hidden, weight, target, fresh_buffer).sum().backward()
    kept = fresh_buffer._free
    assert kept is not None and kept.shape == (2, 5, 16)
    hidden, weight, target = _inputs(1)
    loss = _loss(hidden, weight, target, fresh_buffer)
    assert fresh_buffer._free is None  # lent to the graph of `loss`
    loss.sum().backward()
    assert fresh_buffer._free is kept
    ref_loss, ref_h, ref_w = _reference(hidden, weight, target)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_w, rtol=1e-6, atol=1e-6)


def test_two_live_graphs_get_separate_buffers(fresh_buffer):
    """Two micro-batches' forwards before their backwards (the buffer must not be shared)."""
    first, second = _inputs(2), _inputs(3)
    loss_a = _loss(*first, fresh_buffer)
    loss_b = _loss(*second, fresh_buffer)
    loss_b.sum().backward()
    loss_a.sum().backward()
    for (hidden, weight, target), loss in ((first, loss_a), (second, loss_b)):
        ref_loss, ref_h, ref_w = _reference(hidden, weight, target)
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(weight.grad, ref_w, rtol=1e-6, atol=1e-6)


def test_no_grad_forward_returns_the_buffer_at_once(fresh_buffer):
    hidden, weight, target = _inputs(4)
    with torch.no_grad():
        loss = _loss(hidden, weight, target, fresh_buffer)
    assert fresh_buffer._free is not None
    torch.testing.assert_close(loss, _reference(hidden, weight, target)[0], rtol=1e-6, atol=1e-6)


def test_second_backward_is_a_clear_error(fresh_buffer):
    hidden, weight, target = _inputs(5)
    loss = _loss(hidden, weight, target, fresh_buffer).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="can only run once"):
        loss.backward()


def test_mismatching_kept_buffer_is_not_used(fresh_buffer):
    fresh_buffer.give_back(torch.full((3, 16), float("nan")))
    hidden, weight, target = _inputs(6)
    loss = _loss(hidden, weight, target, fresh_buffer)
    torch.testing.assert_close(loss.detach(), _reference(hidden, weight, target)[0], rtol=1e-6, atol=1e-6)
