"""``DOMINO_KERNELS=compiled``: each transformer block compiled whole (``fullgraph=True``, as torchtitan's
``apply_compile``) computes what the eager block computes, and is applied from outside the model.

Inductor's CPU code generation is real here (the machine has a C compiler; kernels_for falls back to eager without
one), kept to one tiny layer so the compile takes seconds.
"""

from __future__ import annotations

import dataclasses

import torch

from domino.parallel import kernels as kernel_choice
from domino.parallel.kernels import CPU_KERNELS, BLOCK_BACKEND, apply_kernels, compiled_block
from model_fixtures import VOCAB, assert_close_rel, build_model, random_batch, tiny_config

COMPILED_CPU = dataclasses.replace(CPU_KERNELS, compile_blocks=BLOCK_BACKEND)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], labels=batch["labels"])
    (losses * batch["weights"]).sum().backward()
    return losses.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_compiled_block_equals_the_eager_block():
    torch.manual_seed(5)
    model = build_model(tiny_config(num_layers=1), VOCAB, 1)
    model.train()
    names = [n for n, _ in model.named_parameters()]
    batch = random_batch(seed=2)
    torch._dynamo.reset()
    counts_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    expected = _step(model, batch)
    got = _step(apply_kernels(model, COMPILED_CPU), batch)
    # One graph for the block, no graph break (fullgraph would have raised on one).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > counts_before
    assert_close_rel(got[0], expected[0], 1e-5, "losses")
    for name, grad in expected[1].items():
        assert_close_rel(got[1][name], grad, 1e-5, f"grad {name}")
    # Applied from outside: the model's parameters and their names are those of the eager model.
    assert [n for n, _ in model.named_parameters()] == names
    assert compiled_block(model.layers[0], BLOCK_BACKEND) is compiled_block(model.layers[0], BLOCK_BACKEND)


def test_compiled_choice_from_the_environment(monkeypatch):
    assert kernel_choice.from_environment({"DOMINO_KERNELS": "compiled"}) == kernel_choice.COMPILED
    assert kernel_choice.for_device(kernel_choice.COMPILED, torch.device("cpu")) == COMPILED_CPU
    # Without a C compiler inductor cannot build the block: the device's eager choice runs.
    monkeypatch.setattr(kernel_choice, "c_compiler", lambda: None)
    assert kernel_choice.for_device(kernel_choice.COMPILED, torch.device("cpu")) == CPU_KERNELS


def test_compiled_block_with_attention_dropout_draws_the_tp_stream():
    """Training seeds the TP stream and GPT keeps attention dropout: the block compiles (a graph cannot swap
    generators: the fork is made around the call) and draws from the TP stream, the default generator untouched
    (no hidden dropout here: the embedding's draws from the default generator, outside the block)."""
    from domino.parallel import random as tp_random

    tp_random.model_parallel_seed(1234)
    torch.manual_seed(5)
    model = apply_kernels(build_model(tiny_config(num_layers=1, attention_dropout=0.1), VOCAB, 1),
                          COMPILED_CPU)
    model.train()
    batch = random_batch(seed=2)
    default_before, tp_before = torch.get_rng_state(), tp_random.capture_rng_states()["tracker"]
    losses = model(batch["tokens"], labels=batch["labels"])
    losses.sum().backward()
    tp_after = tp_random.capture_rng_states()["tracker"]
    assert torch.isfinite(losses).all()
    assert torch.equal(torch.get_rng_state(), default_before)
    assert any(not torch.equal(tp_before[k], tp_after[k]) for k in tp_before)
