"""``DOMINO_KERNELS=compiled``: each transformer block compiled whole (``fullgraph=True``, as torchtitan's
``apply_compile``) computes what the eager block computes, and is applied from outside the model.

Inductor's CPU code generation is real here (the machine has a C compiler; kernels_for falls back to eager without
one), kept to one tiny layer so the compile takes seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from domino.parallel import kernels as kernel_choice
from domino.parallel.kernels import CPU_KERNELS, BLOCK_BACKEND, apply_kernels
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


def test_blocks_share_one_graph_and_the_compiled_model_can_be_freed():
    """Every block of a model (and of the next model) runs one compiled function, which keeps no model alive."""
    import gc
    import weakref

    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model = apply_kernels(build_model(tiny_config(num_layers=3), VOCAB, 1), COMPILED_CPU)
    _step(model, random_batch(seed=2))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1  # one graph for the three blocks
    weight = weakref.ref(model.layers[0].attention.query_key_value.weight)
    del model
    gc.collect()
    assert weight() is None


def test_past_the_recompile_limit_a_block_runs_eagerly(caplog):
    """fullgraph fails hard at Dynamo's recompile limit: a new shape then runs eagerly, said once, same values."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = build_model(tiny_config(num_layers=1), VOCAB, 1)
    model.train()
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING", logger="domino.parallel.kernels"):
        for seq in (8, 6, 4):  # the first shape compiles; the others are past the limit of 1
            batch = {k: v[..., :seq] if v.dim() == 2 else v for k, v in random_batch(seed=2).items()}
            expected = _step(apply_kernels(model, None), batch)
            got = _step(apply_kernels(model, COMPILED_CPU), batch)
            assert_close_rel(got[0], expected[0], 1e-5, f"losses at sequence {seq}")
    # Said once per compiled function: the block, then the segments its eager run compiles in turn.
    said = [r.getMessage().split(":")[0] for r in caplog.records if r.name == "domino.parallel.kernels"]
    assert said[0] == "_run_block" and len(said) == len(set(said)), said


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


def test_a_nested_tp_fork_keeps_the_streams_advance():
    """Inside a TP fork a nested one is a no-op: an inner fork would give the outer one back its starting state,
    and the next step would draw the same dropout masks again."""
    from domino.parallel import random as tp_random

    tp_random.model_parallel_seed(99)
    masks = []
    for _ in range(2):
        with tp_random.tp_region_rng():
            with tp_random.tp_region_rng():
                masks.append(torch.rand(16))
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.parametrize("chunks", [1, 2], ids=["whole-blocks", "domino-segments"])
def test_selective_recompute_keeps_attention_eager_beside_compiled_parts(chunks):
    """Selective recompute checkpoints attention with the generators' states read, which no graph holds: no block
    is compiled whole, and under Domino's segments attention runs eagerly beside the compiled MLP output; values
    unchanged."""
    from domino.model.recompute import RecomputePlan, apply_activation_recompute

    torch.manual_seed(5)
    model = apply_activation_recompute(build_model(tiny_config(), VOCAB, chunks), RecomputePlan("selective"))
    model.train()
    batch = random_batch(seed=2)
    expected = _step(model, batch)
    got = _step(apply_kernels(model, COMPILED_CPU), batch)
    assert_close_rel(got[0], expected[0], 1e-5, "losses")
    for name, grad in expected[1].items():
        assert_close_rel(got[1][name], grad, 1e-5, f"grad {name}")
