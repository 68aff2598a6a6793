"""The linears' own autograd functions compute exactly what autograd derives from F.linear / F.gelu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domino.parallel.linear_ops import gelu_linear, linear


def _tensors(*shapes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for shape in shapes]


class _RecordingSlot:
    """A :class:`~domino.parallel.linear_ops.GradSlot` that keeps the whole input and records the launches."""

    def __init__(self) -> None:
        self.launched = []

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def restore(self, kept: torch.Tensor):
        return lambda: kept

    def launch(self, grad: torch.Tensor) -> None:
        self.launched.append(grad.clone())


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("out_features", [6, 20])
def test_linear_matches_f_linear_and_launches_the_input_grad_into_the_slot(with_bias, out_features):
    x, weight, bias, upstream = _tensors((2, 3, 8), (out_features, 8), (out_features,), (2, 3, out_features))
    bias = bias if with_bias else None
    leaves = [t.clone().requires_grad_(True) for t in (x, weight) + ((bias,) if with_bias else ())]
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    slot = _RecordingSlot()
    out = linear(leaves[0], leaves[1], leaves[2] if with_bias else None, grad_slot=slot)
    ref = F.linear(*ref_leaves)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.backward(upstream)
    ref.backward(upstream)
    for ours, theirs in zip(leaves, ref_leaves):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    assert len(slot.launched) == 1  # the input gradient, launched once, before the weight gradient exists
    torch.testing.assert_close(slot.launched[0], ref_leaves[0].grad, rtol=1e-12, atol=1e-12)


def test_linear_without_slot_launches_nothing_and_skips_unneeded_grads():
    x, weight = _tensors((4, 8), (6, 8))
    w = weight.clone().requires_grad_(True)
    linear(x, w).sum().backward()  # x needs no gradient
    torch.testing.assert_close(w.grad, torch.ones(4, 6, dtype=x.dtype).t() @ x)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gelu_linear_matches_gelu_then_linear(dtype, with_bias):
    pre, weight, bias, upstream = _tensors((2, 5, 16), (4, 16), (4,), (2, 5, 4), dtype=dtype)
    p, w, b = (t.clone().requires_grad_(True) for t in (pre, weight, bias))
    rp, rw, rb = (t.clone().requires_grad_(True) for t in (pre, weight, bias))
    out = gelu_linear(p, w, b if with_bias else None)
    ref = F.linear(F.gelu(rp), rw, rb if with_bias else None)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref, **tol)
    out.backward(upstream)
    ref.backward(upstream)
    torch.testing.assert_close(p.grad, rp.grad, **tol)
    torch.testing.assert_close(w.grad, rw.grad, **tol)
    if with_bias:
        torch.testing.assert_close(b.grad, rb.grad, **tol)
    torch.testing.assert_close(pre, p.detach())  # the caller's input is untouched


def test_gelu_linear_second_backward_is_a_clear_error():
    pre, weight = _tensors((3, 8), (4, 8))
    loss = gelu_linear(pre.requires_grad_(True), weight).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="can only run once"):
        loss.backward()


def test_gelu_linear_without_grad_is_the_plain_product():
    pre, weight = _tensors((3, 8), (4, 8))
    with torch.no_grad():
        out = gelu_linear(pre, weight.requires_grad_(True))
    assert out.grad_fn is None
    torch.testing.assert_close(out, F.linear(F.gelu(pre), weight))


def test_gelu_linear_backward_allocates_no_activation_sized_tensor():
    """Both gradients of the activation are written into the saved activation's buffer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _FreshOutputs(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.fresh = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            existing = {t.untyped_storage().data_ptr() for t in inputs}
            # Views, out= and in-place ops return memory that already existed; count only new storage.
            self.fresh += [(str(func), t.numel()) for t in torch.utils._pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in existing]
            return out

    pre, weight = _tensors((6, 32), (4, 32))
    p = pre.requires_grad_(True)
    out = gelu_linear(p, weight.requires_grad_(True))
    mode = _FreshOutputs()
    with mode:
        out.backward(torch.ones_like(out))
    assert [name for name, numel in mode.fresh if numel == pre.numel()] == []
    assert any(numel == weight.numel() for _, numel in mode.fresh)  # the mode did see the weight gradient
