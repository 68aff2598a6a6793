"""The compiled islands between the GEMMs (SwiGLU, RoPE) equal their eager form: compiled by inductor on CPU
tensors given the CUDA choices (a C compiler is on this machine's PATH: ``domino.parallel.kernels.c_compiler``),
outputs and gradients within fp32 rounding (inductor may reorder the elementwise maths), and the CPU choice runs
them eagerly."""

import dataclasses

import torch

from domino.model.mlp import _swiglu, swiglu
from domino.model.rotary import RotaryTables, _rotate
from domino.parallel import kernels
from domino.parallel.kernels import CPU_KERNELS, CUDA_KERNELS

INDUCTOR_ON_CPU = dataclasses.replace(CUDA_KERNELS, compile_backend="inductor")


def _compare(fn, eager, *inputs):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves, kernels=INDUCTOR_ON_CPU)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((out * upstream).sum(), leaves)
    ref_leaves = [t.clone().requires_grad_(True) for t in inputs]
    ref = eager(*ref_leaves)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), ref_leaves)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_swiglu_compiled_by_inductor_equals_eager():
    assert kernels.c_compiler() is not None
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(2, 8, 24, generator=g), torch.randn(2, 8, 24, generator=g)
    _compare(swiglu, _swiglu, gate, up)
    # No compile backend: the plain function runs.
    assert torch.equal(swiglu(gate, up, CPU_KERNELS), torch.nn.functional.silu(gate) * up)


def test_rope_compiled_by_inductor_equals_eager():
    g = torch.Generator().manual_seed(1)
    # --rotary-percent 0.5: 4 of 8 dimensions rotated, 4 passed through (both branches of the island)
    tables = RotaryTables.for_positions(torch.arange(6).unsqueeze(0), 4, 10000.0, torch.float32)
    x = torch.randn(2, 3, 6, 8, generator=g)
    _compare(tables.rotate, lambda t: _rotate(t, tables.cos, tables.sin), x)


def _bias_dropout_add_norm_grads(norm, inputs, upstream, kernels):
    from domino.model.transformer import bias_dropout_add_norm

    leaves = [t.clone().requires_grad_(True) for t in inputs]
    norm.zero_grad(set_to_none=True)
    hidden, normed = bias_dropout_add_norm(*leaves[:2], leaves[2], 0.0, True, norm, kernels)
    grads = torch.autograd.grad((hidden * upstream[0]).sum() + (normed * upstream[1]).sum(),
                                leaves + list(norm.parameters()))
    return (hidden, normed), grads


def test_residual_dropout_and_next_norm_compiled_by_inductor_equals_eager():
    """The island of the residual add, its dropout and the next norm (``bias_dropout_add_norm``): inductor's
    kernel equals the eager calls within fp32 rounding, outputs and gradients (x, bias, residual, the norm's
    weight and bias), for LayerNorm (and RMSNorm traced); the CPU choice is the eager calls themselves, bit for bit."""
    from domino.model.transformer import bias_dropout_add

    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 8, 16, generator=g), torch.randn(16, generator=g), torch.randn(2, 8, 16, generator=g)]
    upstream = [torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 16, generator=g)]
    # Inductor compiles C++ for each graph (seconds on a CPU): LayerNorm, the GPT norm, through it, RMSNorm
    # through AOT autograd's trace of the same island (what inductor is handed) run eagerly.
    traced = dataclasses.replace(INDUCTOR_ON_CPU, compile_backend="aot_eager")
    for norm, table in ((torch.nn.LayerNorm(16, eps=1e-5), INDUCTOR_ON_CPU), (torch.nn.RMSNorm(16, eps=1e-5), traced)):
        with torch.no_grad():
            for p in norm.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        out, grads = _bias_dropout_add_norm_grads(norm, inputs, upstream, table)
        ref, ref_grads = _bias_dropout_add_norm_grads(norm, inputs, upstream, CPU_KERNELS)
        hidden = bias_dropout_add(inputs[0], inputs[1], inputs[2], 0.0, True, CPU_KERNELS)
        assert torch.equal(ref[0], hidden) and torch.equal(ref[1], norm(hidden))
        for a, b in zip(list(out) + list(grads), list(ref) + list(ref_grads)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
