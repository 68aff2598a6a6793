"""The split QKV projection (the CPU choice) equals the fused linear it replaces, gradients included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domino.model.qkv_projection import qkv_projection
from domino.parallel.kernels import CPU_KERNELS, CUDA_KERNELS


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
    with pytest.raises(ValueError, match="QKV weight rows 10 are not 3 x 2 groups"):
        qkv_projection(torch.zeros(1, 4), torch.zeros(10, 4), None, groups=2)


@pytest.mark.parametrize("kernels", [CPU_KERNELS, CUDA_KERNELS], ids=["cpu-split", "cuda-one-gemm"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_query_layout_matches_fused_linear(with_bias, kernels):
    """GQA rows [group, (q_1, q_2, k, v), d]: q holds each group's two query heads in order, k and v one head
    (both kernel choices: the CUDA one given to CPU tensors)."""
    g = torch.Generator().manual_seed(1)
    groups, per_group, d, hidden = 2, 2, 3, 5
    x = torch.randn(2, 4, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(groups * (per_group + 2) * d, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(w.shape[0], generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    fused = F.linear(x, w, b).view(2, 4, groups, per_group + 2, d)
    ref = (fused[..., :per_group, :].reshape(2, 4, -1, d), fused[..., per_group, :], fused[..., per_group + 1, :])
    upstream = [torch.randn_like(r) for r in ref]
    want = torch.autograd.grad(sum((r * u).sum() for r, u in zip(ref, upstream)), [w] + ([b] if with_bias else []))
    got_out = qkv_projection(x, w, b, groups, queries_per_group=per_group, kernels=kernels)
    for got, expected in zip(got_out, ref):
        torch.testing.assert_close(got, expected)
    got = torch.autograd.grad(sum((o * u).sum() for o, u in zip(got_out, upstream)), [w] + ([b] if with_bias else []))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("queries_per_group", [1, 2])
def test_cuda_views_backward_is_one_concatenation_bit_identical_to_indexing(queries_per_group):
    """The CUDA choice's q, k, v come from one ``torch.split`` of the product: backward is one node that
    concatenates their gradients (SplitWithSizesBackward), no zero-filled ``[.., 3h]`` tensor per slice, and the
    weight and input gradients are bit for bit those of indexing the product three times."""
    g = torch.Generator().manual_seed(2)
    groups, d, hidden, per_group = 2, 4, 6, queries_per_group + 2
    x = torch.randn(3, 5, hidden, generator=g, requires_grad=True)
    w = torch.randn(groups * per_group * d, hidden, generator=g, requires_grad=True)
    upstream = None
    outs = qkv_projection(x, w, None, groups, queries_per_group=queries_per_group, kernels=CUDA_KERNELS)
    upstream = [torch.randn(o.shape, generator=g) for o in outs]
    got = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outs, upstream)), [x, w])
    for out in outs[1:]:  # k and v: a squeeze of one split output
        assert type(out.grad_fn.next_functions[0][0]).__name__ == "SplitWithSizesBackward0"
    mixed = F.linear(x, w).view(3, 5, groups, per_group, d)
    ref = (mixed[..., :queries_per_group, :].reshape(3, 5, -1, d), mixed[..., queries_per_group, :],
           mixed[..., queries_per_group + 1, :])
    want = torch.autograd.grad(sum((r * u).sum() for r, u in zip(ref, upstream)), [x, w])
    for o, r in zip(outs, ref):
        assert torch.equal(o, r)
    for a, e in zip(got, want):
        assert torch.equal(a, e)
