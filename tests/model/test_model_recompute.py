"""Activation recompute: the same losses and gradients with dropout on, at TP=2 with and without Domino, and
less memory kept by the forward."""

from __future__ import annotations

import pytest
import torch

from distributed_helpers import run_distributed
from domino.config import ModelConfig
from domino.model.recompute import RecomputePlan, apply_activation_recompute
from domino.runtime import state
from domino.parallel.random import model_parallel_seed
from model_fixtures import build_model, train_and_measure

VOCAB = 128
PLANS = {
    "none": None,
    "selective": RecomputePlan("selective"),
    "full-uniform-1": RecomputePlan("full", "uniform", 1),
    "full-uniform-2": RecomputePlan("full", "uniform", 2),
    "full-block-1": RecomputePlan("full", "block", 1),
}


def _config() -> ModelConfig:
    return ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.2,
                       attention_dropout=0.2)


def _train(plan, chunks: int, steps: int = 3):
    """Losses of ``steps`` SGD steps, the last gradients, and the tensor bytes the first forward kept."""
    # Same weights, same dropout streams (the TP stream per rank) for every plan.
    model_parallel_seed(11, state.current_mesh().tp.rank)
    model = apply_activation_recompute(build_model(_config(), VOCAB, chunks), plan)
    g = torch.Generator().manual_seed(5)
    tokens, labels = (torch.randint(0, VOCAB, (4, 16), generator=g) for _ in range(2))
    model.eval()  # without dropout (eval mode draws nothing, so the streams stay where they are)
    with torch.no_grad():
        no_dropout = model(tokens, labels=labels).mean().item()
    model.train()
    losses, grads, kept = train_and_measure(model, VOCAB, steps)
    model.eval()
    with torch.no_grad():  # evaluation and generation run the plain path
        cache = model.new_kv_cache()
        model(tokens[:1, :4], kv_cache=cache)
        assert cache.length == 4
    return losses, grads, kept, no_dropout


def _tp2_body(rank, world_size):
    state.initialize_model_parallel(2)
    return {(name, chunks): _train(plan, chunks) for chunks in (1, 2) for name, plan in PLANS.items()}


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(_tp2_body, 2)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("name", [n for n in PLANS if n != "none"])
def test_recompute_gives_identical_losses_and_gradients_at_tp2(tp2_results, name, chunks):
    for rank, results in enumerate(tp2_results):
        losses, grads = results[(name, chunks)][:2]
        base_losses, base_grads = results[("none", chunks)][:2]
        assert losses == base_losses, f"rank {rank}: {losses} != {base_losses}"
        for key, grad in base_grads.items():
            assert torch.equal(grads[key], grad), f"rank {rank}: gradient of {key} differs"


def test_dropout_is_on_and_recompute_keeps_less(tp2_results):
    results = tp2_results[0]
    kept = {name: results[(name, 2)][2] for name in PLANS}
    assert kept["none"] > kept["selective"] > kept["full-block-1"] > kept["full-uniform-1"] > kept["full-uniform-2"]
    for chunks in (1, 2):  # dropout really is on, so identical losses mean identical masks
        losses, _, _, no_dropout = results[("none", chunks)]
        assert abs(losses[0] - no_dropout) > 1e-4


def test_units_follow_megatron_uniform_and_block():
    assert RecomputePlan("full", "uniform", 2).units(5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert RecomputePlan("full", "block", 2).units(5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert RecomputePlan("full", "block", 3).units(3) == [(0, 1, True), (1, 2, True), (2, 3, True)]
    assert RecomputePlan("selective").units(4) == [(0, 4, False)]
