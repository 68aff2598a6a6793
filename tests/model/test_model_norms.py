"""The norms and GeLU (domino.parallel.norms): torch's one-op forms, which the CPU and CUDA choices run, equal the
textbook formulas, which the plain choice runs (outputs and gradients, fp32), and each choice takes its own form
inside the model: a ``TorchFunctionMode`` sees ``F.layer_norm`` / ``F.rms_norm`` / ``F.gelu`` called, or not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from domino.parallel import norms
from domino.parallel.kernels import CPU_KERNELS, CUDA_KERNELS, PLAIN_KERNELS, apply_kernels
from model_fixtures import VOCAB, assert_close_rel, build_model, random_batch, tiny_config


def _with_grads(fn, *tensors):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    return [out.detach()] + [leaf.grad for leaf in leaves]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 3, 24, generator=g) * 3 + 1, torch.rand(24, generator=g) + 0.5, torch.randn(24, generator=g)


def test_textbook_layer_norm_equals_torchs():
    x, w, b = _inputs()
    ours = _with_grads(lambda x, w, b: norms.textbook_layer_norm(x, w, b, 1e-5), x, w, b)
    torchs = _with_grads(lambda x, w, b: F.layer_norm(x, (24,), w, b, 1e-5), x, w, b)
    for a, e in zip(ours, torchs):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_textbook_rms_norm_equals_torchs():
    x, w, _ = _inputs(1)
    ours = _with_grads(lambda x, w: norms.textbook_rms_norm(x, w, 1e-6), x, w)
    torchs = _with_grads(lambda x, w: F.rms_norm(x, (24,), w, 1e-6), x, w)
    for a, e in zip(ours, torchs):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_textbook_gelu_equals_torchs(approximate):
    x, _, _ = _inputs(2)
    ours = _with_grads(lambda x: norms.textbook_gelu(x, approximate), x)
    torchs = _with_grads(lambda x: F.gelu(x, approximate=approximate), x)
    for a, e in zip(ours, torchs):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


class _Calls(TorchFunctionMode):
    """Records which of torch's norm and GeLU functions were called."""

    WATCHED = {F.layer_norm: "layer_norm", F.rms_norm: "rms_norm", torch.rms_norm: "rms_norm", F.gelu: "gelu"}

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WATCHED:
            self.seen.add(self.WATCHED[func])
        return func(*args, **(kwargs or {}))


def _step(config, kernels):
    torch.manual_seed(3)
    model = apply_kernels(build_model(config, VOCAB, 1), kernels)
    batch = random_batch(seed=4)
    calls = _Calls()
    with calls:
        losses = model(batch["tokens"], labels=batch["labels"])
        (losses * batch["weights"]).sum().backward()
    return losses.detach(), {n: p.grad for n, p in model.named_parameters()}, calls.seen


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_each_choice_runs_its_own_norms_and_gelu_and_all_agree(normalization):
    config = tiny_config(normalization=normalization, norm_epsilon=1e-5)
    norm = "rms_norm" if normalization == "RMSNorm" else "layer_norm"
    plain_losses, plain_grads, plain_seen = _step(config, PLAIN_KERNELS)
    assert plain_seen == set()
    for kernels in (CPU_KERNELS, dataclasses.replace(CUDA_KERNELS, compile_backend=None)):
        losses, grads, seen = _step(config, kernels)
        assert seen == {norm, "gelu"}, kernels  # the CPU's GeLU + fc2 node calls F.gelu too
        assert_close_rel(losses, plain_losses, 1e-5, "losses")
        for name, grad in plain_grads.items():
            assert_close_rel(grads[name], grad, 1e-5, f"grad {name}")
