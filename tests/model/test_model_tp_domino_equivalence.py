"""TP=1, TP=2, and TP=2 with Domino (2 and 4 chunks) give the same logits, losses and gradients.

Reference: the unsharded model at TP=1 without Domino. The TP=2 ranks load slices of the same weights
(``shard_state_dict``) and their gradients are joined back (``merge_tp_shards``) for comparison.
"""

from __future__ import annotations

import pytest
import torch

from distributed_helpers import run_distributed
from domino.model import GPTModel
from domino.checkpoint.sharding import merge_tp_shards, shard_state_dict
from domino.runtime import state
from model_fixtures import VOCAB, assert_close_rel, build_model, logits_losses_grads, random_batch, tiny_config

CHUNKS = (1, 2, 4)
REL = 1e-5


def _tp2_body(rank, world_size, full_sd, batch):
    from domino.checkpoint.sharding import shard_state_dict as shard

    state.initialize_model_parallel(2)
    results = {}
    for chunks in CHUNKS:
        model = build_model(tiny_config(), VOCAB, chunks, parallel_output=False)
        model.load_state_dict(shard(full_sd, rank, 2))
        for masked in (False, True):
            results[(chunks, masked)] = logits_losses_grads(model, batch, masked)
    return results


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(7)
    model = GPTModel(tiny_config(), VOCAB)
    batch = random_batch(seed=3)
    full_sd = {k: v.clone() for k, v in model.state_dict().items()}
    expected = {masked: logits_losses_grads(model, batch, masked) for masked in (False, True)}
    return full_sd, batch, expected


@pytest.fixture(scope="module")
def tp2_results(reference):
    full_sd, batch, _ = reference
    return run_distributed(_tp2_body, 2, full_sd, batch)


def _compare(got, expected, label):
    logits, losses, grads = got
    ref_logits, ref_losses, ref_grads = expected
    assert_close_rel(logits, ref_logits, REL, f"{label} logits")
    assert_close_rel(losses, ref_losses, REL, f"{label} losses")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_close_rel(grads[name], ref_grads[name], REL, f"{label} grad {name}")


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "reset-mask"])
def test_tp1_domino_two_chunks_matches_reference(reference, masked):
    full_sd, batch, expected = reference
    model = build_model(tiny_config(), VOCAB, 2)
    model.load_state_dict(full_sd)
    _compare(logits_losses_grads(model, batch, masked), expected[masked], f"TP=1 chunks=2 masked={masked}")


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "reset-mask"])
def test_tp2_matches_reference(reference, tp2_results, chunks, masked):
    _, _, expected = reference
    per_rank = [r[(chunks, masked)] for r in tp2_results]
    for rank, (logits, losses, _) in enumerate(per_rank):
        assert_close_rel(logits, expected[masked][0], REL, f"rank {rank} logits")
        assert_close_rel(losses, expected[masked][1], REL, f"rank {rank} losses")
    merged = merge_tp_shards([grads for _, _, grads in per_rank])
    _compare((per_rank[0][0], per_rank[0][1], merged), expected[masked], f"TP=2 chunks={chunks} masked={masked}")


def test_mask_changes_the_result(reference):
    """Guards the masked cases above against a mask that is silently ignored."""
    _, _, expected = reference
    assert not torch.allclose(expected[True][1], expected[False][1])


def test_shard_round_trip_and_params_differ_between_ranks(reference):
    full_sd, _, _ = reference
    shards = [shard_state_dict(full_sd, r, 2) for r in range(2)]
    qkv = "layers.0.attention.query_key_value.weight"
    assert shards[0][qkv].shape[0] == full_sd[qkv].shape[0] // 2
    assert not torch.equal(shards[0][qkv], shards[1][qkv])
    merged = merge_tp_shards(shards)
    assert merged.keys() == full_sd.keys()
    for name, tensor in full_sd.items():
        assert torch.equal(merged[name], tensor), name
