"""The split QKV projection (the CPU choice) equals the fused linear it replaces, gradients included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domino.model.qkv_projection import qkv_projection


def _inputs(with_bias: bool):
    g = torch.Generator().manual_seed(0)
    heads, head_dim, hidden = 2, 4, 6
    x = torch.randn(3, 5, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(heads * 3 * head_dim, hidden, generator=g, dtype=torch.float64)
    b = torch.randn(heads * 3 * head_dim, generator=g, dtype=torch.float64) if with_bias else None
    return x, w, b, heads, head_dim


@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_fused_linear_and_its_gradients(with_bias):
    x, w, b, heads, d = _inputs(with_bias)
    upstream = [torch.randn(3, 5, heads, d, dtype=torch.float64) for _ in range(3)]
    leaves = [t.clone().requires_grad_(True) for t in (x, w) + ((b,) if with_bias else ())]
    fused = F.linear(leaves[0], leaves[1], leaves[2] if with_bias else None).view(3, 5, heads, 3, d)
    ref = [fused[:, :, :, i] for i in range(3)]  # [3, 5, heads, d]
    sum((r * u).sum() for r, u in zip(ref, upstream)).backward()
    mine = [t.clone().requires_grad_(True) for t in (x, w) + ((b,) if with_bias else ())]
    q, k, v = qkv_projection(mine[0], mine[1], mine[2] if with_bias else None, heads)
    for got, want in zip((q, k, v), ref):
        torch.testing.assert_close(got, want)
        assert got.is_contiguous()
    sum((t * u).sum() for t, u in zip((q, k, v), upstream)).backward()
    for got, want in zip(mine, leaves):
        torch.testing.assert_close(got.grad, want.grad)


def test_unused_output_gets_a_zero_gradient():
    x, w, b, heads, _ = _inputs(True)
    w = w.requires_grad_(True)
    q, _, _ = qkv_projection(x, w, b, heads)
    q.sum().backward()
    assert w.grad.view(heads, 3, -1, w.shape[1])[:, 1:].abs().max() == 0


def test_rows_not_divisible_by_three_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="QKV weight rows 10 are not 3 x 2 heads"):
        qkv_projection(torch.zeros(1, 4), torch.zeros(10, 4), None, heads=2)
