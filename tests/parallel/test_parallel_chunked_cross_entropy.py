"""The chunked output layer + loss (domino.parallel.chunked_cross_entropy) equals the one-buffer fused loss, the
plain path (a linear, then the vocab-parallel loss) and ``F.cross_entropy`` on full logits: losses and both
gradients, at TP=1 and over two gloo ranks, in fp32 (within fp32 rounding: the same maths in another order) and in
fp16 with a loss scale (the scale multiplies in fp32 before the cast); it makes one pass over each chunk of logits
in forward and one in backward besides the GEMMs; the kernel choice routes large losses through it on CUDA only."""

import dataclasses
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from distributed_helpers import run_distributed
from domino.parallel.chunked_cross_entropy import chunked_linear_cross_entropy
from domino.parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from domino.parallel.kernels import CPU_KERNELS, CUDA_KERNELS, PLAIN_KERNELS
from domino.runtime.mesh import SINGLE
from torch.utils._python_dispatch import TorchDispatchMode

TOKENS, H, V = (3, 7), 16, 40  # 21 tokens: chunks of 5 leave a short last one


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*TOKENS, H, generator=g) * 2).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    target = torch.randint(0, V, TOKENS, generator=g)
    upstream = torch.rand(*TOKENS, generator=g)
    return hidden, weight, target, upstream


def _grads(loss_fn, hidden, weight, target, upstream):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight, target)
    (loss * upstream).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def _full(hidden, weight, target):
    logits = hidden.float() @ weight.float().t()
    return F.cross_entropy(logits.view(-1, V), target.view(-1), reduction="none").view(target.shape)


def _plain(hidden, weight, target, tp=None):
    """The reference path: the output layer as a linear, then the vocab-parallel loss, with the plain kernels."""
    logits = F.linear(hidden, weight)
    return vocab_parallel_cross_entropy(logits, target, SINGLE if tp is None else tp, kernels=PLAIN_KERNELS)


@pytest.mark.parametrize("chunk_rows", [1, 5, 21, 64])
def test_chunked_equals_the_one_buffer_loss_and_f_cross_entropy_in_fp32(chunk_rows):
    inputs = _inputs()
    chunked = _grads(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk_rows), *inputs)
    fused = _grads(vocab_parallel_linear_cross_entropy, *inputs)
    reference = _grads(_full, *inputs)
    plain = _grads(_plain, *inputs)
    for ours, theirs, ref, textbook in zip(chunked, fused, reference, plain):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours, textbook, rtol=1e-5, atol=1e-6)


class _LogitsPasses(TorchDispatchMode):
    """Counts the ops that pass over a ``[chunk, V]`` tensor other than the GEMMs and the one-element-per-row
    gathers and scatters (the one-hot), by op name."""

    GEMMS_AND_INDEXING = {"mm", "addmm", "addmm_", "gather", "scatter_add_", "t", "view", "detach", "empty_like",
                          "empty", "zeros"}

    def __init__(self, logits_numel):
        super().__init__()
        self.logits_numel, self.passes = logits_numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors = [t for t in (*args, *(kwargs or {}).values(), out) if isinstance(t, torch.Tensor)]
        if name not in self.GEMMS_AND_INDEXING and any(t.numel() == self.logits_numel for t in tensors):
            self.passes.append(name)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_pass_over_each_chunk_of_logits_in_forward_and_in_backward(dtype):
    """Forward: the log-softmax kernel only (log-sum-exp and target logit read from it); backward: the softmax
    recomputed by one ``exp`` of the GEMM shifted by the saved log-sum-exp (fp32: the shift rides in the GEMM; the
    per-token factor scales the ``[chunk, h]`` operands), in 16 bits plus the shift's subtraction and one scaling
    cast."""
    hidden, weight, target, upstream = _inputs(dtype)
    hidden, weight = hidden[:, :5].clone().requires_grad_(), weight.clone().requires_grad_()  # 15 rows: 3 chunks
    forward = _LogitsPasses(5 * V)
    with forward:
        loss = chunked_linear_cross_entropy(hidden, weight, target[:, :5], 5)
    backward = _LogitsPasses(5 * V)
    with backward:
        (loss * upstream[:, :5]).sum().backward()
    if dtype == torch.float32:
        assert forward.passes == ["_log_softmax"] * 3
        assert backward.passes == ["exp_"] * 3
    else:  # CPU's kernel has no half_to_float (CUDA's converts as it reads); the shift; the scale with the cast
        assert forward.passes == ["_to_copy", "_log_softmax"] * 3
        assert sorted(backward.passes) == sorted(["sub", "exp_", "mul"] * 3)


def test_fp16_with_a_loss_scale_equals_the_one_buffer_loss():
    """With a loss scale small probabilities survive in fp16 only if the scale multiplies first (2^8 here: the
    gradients stay within fp16's range)."""
    hidden, weight, target, upstream = _inputs(torch.float16)
    upstream = upstream * 2**8
    chunked = _grads(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, 5), hidden, weight, target, upstream)
    fused = _grads(vocab_parallel_linear_cross_entropy, hidden, weight, target, upstream)
    assert chunked[0].dtype == torch.float32 and chunked[1].dtype == chunked[2].dtype == torch.float16
    torch.testing.assert_close(chunked[0], fused[0], rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(chunked[1:], fused[1:]):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=5e-3, atol=2e-3 * 2**8)


def test_the_cuda_choice_chunks_and_the_cpu_choice_keeps_one_buffer():
    inputs = _inputs()
    small_chunks = dataclasses.replace(CUDA_KERNELS, compile_backend=None, loss_chunk_bytes=4 * V * 5)  # 5 rows
    calls = []
    import domino.parallel.cross_entropy as ce

    original = ce.chunked_linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(args[3])
        return original(*args, **kwargs)

    ce.chunked_linear_cross_entropy = spy
    try:
        chunked = _grads(partial(vocab_parallel_linear_cross_entropy, kernels=small_chunks), *inputs)
        plain = _grads(partial(vocab_parallel_linear_cross_entropy, kernels=CPU_KERNELS), *inputs)
    finally:
        ce.chunked_linear_cross_entropy = original
    assert calls == [5] and CPU_KERNELS.loss_chunk_bytes is None and CUDA_KERNELS.loss_chunk_bytes == 2**30
    for ours, theirs in zip(chunked, plain):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _tp2_body(rank, world_size, hidden, weight, target, upstream):
    from domino.runtime import state
    from domino.parallel.collectives import copy_to_tp_region

    tp = state.initialize_model_parallel(2).tp
    shard = weight[rank * V // 2:(rank + 1) * V // 2]

    def loss_fn(h, w, t):
        return chunked_linear_cross_entropy(copy_to_tp_region(h, tp), w, t, 4, tp)

    def plain_fn(h, w, t):
        return _plain(copy_to_tp_region(h, tp), w, t, tp)

    return _grads(loss_fn, hidden, shard, target, upstream), _grads(plain_fn, hidden, shard, target, upstream)


def test_two_ranks_equal_the_full_logits_loss_and_the_plain_path():
    hidden, weight, target, upstream = _inputs(seed=3)
    loss, grad_hidden, grad_weight = _grads(_full, hidden, weight, target, upstream)
    results = run_distributed(_tp2_body, 2, hidden, weight, target, upstream)
    for rank, ((r_loss, r_hidden, r_weight), plain) in enumerate(results):
        torch.testing.assert_close(r_loss, loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r_hidden, grad_hidden, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r_weight, grad_weight[rank * V // 2:(rank + 1) * V // 2], rtol=1e-5, atol=1e-6)
        for ours, textbook in zip((r_loss, r_hidden, r_weight), plain):
            torch.testing.assert_close(ours, textbook, rtol=1e-5, atol=1e-6)


def test_the_estimate_counts_one_chunk_of_logits_on_gpus():
    from domino.config import parse_config
    from domino.config.estimate import Layout, estimate_layout
    from domino.config.memory_formulas import GPU_LOSS_CHUNK_BYTES

    assert GPU_LOSS_CHUNK_BYTES == CUDA_KERNELS.loss_chunk_bytes
    config = parse_config(["--preset", "gpt3-1.3b", "--vocab-size", "50257", "--bf16"])
    layout = Layout(micro_batch_size=16)
    gpu, cpu = estimate_layout(config, layout, device="gpu"), estimate_layout(config, layout, device="cpu")
    assert cpu.logits / 2**30 == pytest.approx(9.2, abs=0.05)  # [32768 tokens, 50304] in fp32 + bf16
    # one 1 GiB fp32 chunk, its bf16 GEMM output (0.5 GiB) and the output layer's fp32 gradient + bf16 part (0.58)
    assert gpu.logits / 2**30 == pytest.approx(2.08, abs=0.01)
