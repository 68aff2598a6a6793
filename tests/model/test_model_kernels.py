"""The CUDA and the plain kernel choices (domino.parallel.kernels), given to CPU tensors, compute what the CPU
choices compute.

The compiled bias-dropout-add is compiled with torch's ``aot_eager`` backend here: the same Dynamo capture and
AOT-autograd graph as on CUDA, run with eager kernels (Inductor's CPU code generation would take ~40 s on this
machine; the GPU check, ``benchmarks/gpu_check.sh``, runs the real thing).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from distributed_helpers import run_distributed
from domino.model import GPTModel
from domino.model.qkv_projection import qkv_projection
from domino.checkpoint.sharding import merge_tp_shards, shard_state_dict
from domino.model.transformer import bias_dropout_add
from domino.parallel import cross_entropy
from domino.runtime import state
from domino.config import ConfigError
from domino.parallel import kernels as kernel_choice
from domino.parallel.kernels import CPU_KERNELS, CUDA_KERNELS, PLAIN_KERNELS, apply_kernels, kernels_for
from model_fixtures import VOCAB, assert_close_rel, build_model, random_batch, tiny_config

CUDA_ON_CPU = dataclasses.replace(CUDA_KERNELS, compile_backend="aot_eager")
REL = 1e-5


def test_choices_by_device_type():
    assert kernels_for(torch.device("cpu")) == CPU_KERNELS
    assert kernels_for(torch.device("cuda", 3)) == CUDA_KERNELS
    # Every op has more than one implementation among the choices (a field equal in all would decide nothing),
    # and the plain choice takes none of the CPU's fast paths, compiles nothing and chunks nothing.
    for field in dataclasses.fields(CPU_KERNELS):
        values = {getattr(k, field.name) for k in (CPU_KERNELS, CUDA_KERNELS, PLAIN_KERNELS,
                                                   kernel_choice.with_compiled_blocks(CPU_KERNELS))}
        assert len(values) > 1, field.name
        if field.name not in ("compile_backend", "loss_chunk_bytes", "compile_blocks"):
            assert getattr(PLAIN_KERNELS, field.name) != getattr(CPU_KERNELS, field.name), field.name
    assert PLAIN_KERNELS.compile_backend is None and PLAIN_KERNELS.loss_chunk_bytes is None


def test_plain_choice_from_the_environment():
    assert kernel_choice.from_environment({}) is None
    assert kernel_choice.from_environment({"DOMINO_KERNELS": "auto"}) is None
    assert kernel_choice.from_environment({"DOMINO_KERNELS": " Plain "}) == PLAIN_KERNELS
    with pytest.raises(ConfigError, match="DOMINO_KERNELS='fast': expected plain, compiled or auto"):
        kernel_choice.from_environment({"DOMINO_KERNELS": "fast"})
    # The choice is a value: its table for each device, whatever the device.
    assert kernel_choice.for_device(PLAIN_KERNELS, torch.device("cuda")) == PLAIN_KERNELS
    assert kernel_choice.for_device(None, torch.device("cpu")) == CPU_KERNELS


def test_cuda_runs_the_fusions_eagerly_without_a_c_compiler(monkeypatch, tmp_path):
    """Inductor and Triton need a C compiler; on a CUDA machine without one the compiled islands run eagerly."""
    from domino.parallel import kernels

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no cc, gcc or clang
    kernels.c_compiler.cache_clear()
    try:
        assert kernels.c_compiler() is None
        assert kernels_for(torch.device("cuda")) == dataclasses.replace(CUDA_KERNELS, compile_backend=None)
        compiler = tmp_path / "cc"
        compiler.write_text("#!/bin/sh\n")
        compiler.chmod(0o755)
        kernels.c_compiler.cache_clear()
        assert kernels.c_compiler() == str(compiler)
        assert kernels_for(torch.device("cuda")) == CUDA_KERNELS
    finally:
        kernels.c_compiler.cache_clear()


@pytest.mark.parametrize("with_bias", [True, False])
def test_qkv_one_gemm_equals_three_gemms(with_bias):
    g = torch.Generator().manual_seed(0)
    heads, d = 2, 4
    x, w = torch.randn(3, 5, 6, generator=g, dtype=torch.float64), torch.randn(heads * 3 * d, 6, generator=g,
                                                                                dtype=torch.float64)
    b = torch.randn(heads * 3 * d, generator=g, dtype=torch.float64) if with_bias else None
    upstream = [torch.randn(3, 5, heads, d, generator=g, dtype=torch.float64) for _ in range(3)]
    results = []
    for kernels in (CPU_KERNELS, CUDA_ON_CPU):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b) if t is not None]
        outs = qkv_projection(leaves[0], leaves[1], leaves[2] if with_bias else None, heads, kernels=kernels)
        sum((o * u).sum() for o, u in zip(outs, upstream)).backward()
        results.append(([o.detach() for o in outs], [t.grad for t in leaves]))
    (cpu_outs, cpu_grads), (cuda_outs, cuda_grads) = results
    assert all(o.is_contiguous() for o in cpu_outs) and not any(o.is_contiguous() for o in cuda_outs)
    for got, want in zip(cuda_outs + cuda_grads, cpu_outs + cpu_grads):
        torch.testing.assert_close(got, want)


def _model_loss_step(model, seed: int) -> None:
    batch = random_batch(seed=seed)
    model(batch["tokens"], labels=batch["labels"]).sum().backward()


def test_logits_buffer_is_the_models_and_follows_its_table():
    """The model keeps its loss's buffer with a table that keeps one (CPU's), none with one that does not (as CUDA's),
    whichever table ``apply_kernels`` gave it last; the buffer is never part of the state dict."""
    torch.manual_seed(0)
    model = GPTModel(tiny_config(), VOCAB)
    no_kept_buffer = dataclasses.replace(CPU_KERNELS, keep_logits_buffer=False)  # as CUDA's, nothing compiled
    apply_kernels(model, no_kept_buffer)
    _model_loss_step(model, 1)
    assert model.logits_buffer is None
    apply_kernels(model, None)  # the device's own: CPU's
    _model_loss_step(model, 1)
    kept = model.logits_buffer._free
    assert kept is not None and kept.shape == (8, 4, VOCAB)  # [s, b, V]
    _model_loss_step(model, 2)
    assert model.logits_buffer._free is kept  # re-used, and back after the backward
    apply_kernels(model, no_kept_buffer)
    _model_loss_step(model, 1)
    assert model.logits_buffer is None  # dropped with the table that keeps none
    assert not any("logits" in name for name in model.state_dict())


def test_two_models_do_not_share_a_logits_buffer():
    torch.manual_seed(0)
    first, second = GPTModel(tiny_config(), VOCAB), GPTModel(tiny_config(), VOCAB)
    _model_loss_step(first, 1)
    _model_loss_step(second, 1)
    assert first.logits_buffer is not second.logits_buffer
    assert first.logits_buffer._free is not None and second.logits_buffer._free is not None
    assert first.logits_buffer._free.data_ptr() != second.logits_buffer._free.data_ptr()
    # A copy of a model gets an empty buffer of its own.
    copied = copy.deepcopy(first)
    assert copied.logits_buffer is not first.logits_buffer and copied.logits_buffer._free is None


def test_compiled_bias_dropout_add_is_a_dropout_of_bias_plus_x():
    g = torch.Generator().manual_seed(2)
    x, bias, residual = (torch.randn(*shape, generator=g, requires_grad=True) for shape in ((4, 8, 16), (16,),
                                                                                           (4, 8, 16)))
    out = bias_dropout_add(x, bias, residual, 0.25, training=True, kernels=CUDA_ON_CPU)
    out.sum().backward()
    kept = (out - residual).detach() != 0
    assert 0.6 < kept.float().mean() < 0.9  # ~75% kept
    torch.testing.assert_close((out - residual).detach()[kept], ((x + bias) / 0.75).detach()[kept])
    torch.testing.assert_close(x.grad, kept.float() / 0.75)  # the gradient uses the forward's mask
    torch.testing.assert_close(residual.grad, torch.ones_like(residual))


def _step(model, batch, masked: bool):
    extra = dict(attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]) if masked else {}
    model.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], labels=batch["labels"], **extra)
    (losses * batch["weights"]).sum().backward()
    return losses.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compare(got, expected, label):
    assert_close_rel(got[0], expected[0], REL, f"{label} losses")
    for name, grad in expected[1].items():
        assert_close_rel(got[1][name], grad, REL, f"{label} grad {name}")


#: A LLaMA-family layer (rotary, RMSNorm, SwiGLU, no biases, GQA with 2 query groups of 2 heads, untied output).
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
             disable_bias_linear=True, untie_embeddings_and_output_weights=True, group_query_attention=True,
             num_query_groups=2)


@pytest.mark.parametrize("choice", [CUDA_ON_CPU, PLAIN_KERNELS], ids=["cuda", "plain"])
@pytest.mark.parametrize("architecture", [{}, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("chunks", [1, 2])
def test_whole_model_choices_equal_cpu_choices(chunks, architecture, choice):
    """Every op at once, through the synchronous and the Domino stacks, with a reset-attention mask: the CUDA
    choices, and the plain one (one QKV GEMM, F.gelu then fc2, eager bias-dropout-add, logits then the loss)."""
    torch.manual_seed(7)
    model = build_model(tiny_config(**architecture), VOCAB, chunks)
    batch = random_batch(seed=3)
    expected = _step(model, batch, masked=True)
    got = _step(apply_kernels(model, choice), batch, masked=True)
    _compare(got, expected, f"chunks={chunks}")


def _tp2_body(rank, world_size, full_sd, batch):
    import dataclasses as dc

    from domino.parallel.kernels import CUDA_KERNELS as cuda, apply_kernels as given

    state.initialize_model_parallel(2)
    model = build_model(tiny_config(), VOCAB, 2)
    model.load_state_dict(shard_state_dict(full_sd, rank, 2))
    return _step(given(model, dc.replace(cuda, compile_backend="aot_eager")), batch, masked=False)


def test_tp2_domino_with_cuda_choices_equals_tp1_cpu_choices():
    """The one-GEMM QKV launches its input-gradient all-reduce into Domino's slot like the other linears."""
    torch.manual_seed(7)
    model = GPTModel(tiny_config(), VOCAB)
    batch = random_batch(seed=4)
    full_sd = {k: v.clone() for k, v in model.state_dict().items()}
    expected = _step(model, batch, masked=False)
    per_rank = run_distributed(_tp2_body, 2, full_sd, batch)
    merged = merge_tp_shards([grads for _, grads in per_rank])
    _compare((per_rank[0][0], merged), expected, "TP=2 Domino, CUDA choices")


def test_tp1_loss_without_host_read_equals_the_softmax_shortcut():
    """The CUDA choice at TP=1 (log-sum-exp from the logits) reads nothing on the host and gives the CPU
    choice's losses and gradients, also for rows whose target probability underflows fp32 (loss > 100)."""
    from domino.train.host_syncs import HostSyncProbe

    g = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(2, 6, 8, generator=g), torch.randn(32, 8, generator=g)
    hidden[0, :3] *= 60.0  # huge logits: these rows' target probabilities are far below 1e-30
    target = torch.randint(0, 32, (2, 6), generator=g)
    results = []
    for kernels in (CPU_KERNELS, CUDA_ON_CPU):
        h = hidden.clone().requires_grad_(True)
        with HostSyncProbe() as probe:
            loss = cross_entropy.vocab_parallel_linear_cross_entropy(h, weight, target, kernels=kernels)
        loss.sum().backward()
        results.append((loss.detach(), h.grad, sum(probe.events.values())))
    (cpu_loss, cpu_grad, cpu_reads), (cuda_loss, cuda_grad, cuda_reads) = results
    assert cpu_loss.max() > 100 and cpu_reads >= 1 and cuda_reads == 0  # the CPU fallback did run
    torch.testing.assert_close(cuda_loss, cpu_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(cuda_grad, cpu_grad)
