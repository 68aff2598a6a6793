"""LLaMA-family variants: TP=2 with and without Domino equals the unsharded model; GQA, RoPE and the KV cache.

Reference: the unsharded model at TP=1 without Domino, as in test_model_tp_domino_equivalence.py. The masked case
feeds per-sample position ids (documents restart at 0), so the rotary tables differ along the batch and Domino
must split them with the batch.
"""

from __future__ import annotations

import pytest
import torch

from distributed_helpers import run_distributed
from domino.model import GPTModel
from domino.checkpoint.sharding import merge_tp_shards
from domino.runtime import state
from model_fixtures import VOCAB, assert_close_rel, build_model, logits_losses_grads, random_batch, tiny_config

REL = 1e-5
VARIANTS = {
    # Every LLaMA piece at once: rotary positions, RMSNorm, SwiGLU, no biases, GQA (one group per TP rank), untied.
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
                  disable_bias_linear=True, untie_embeddings_and_output_weights=True, group_query_attention=True,
                  num_query_groups=2, norm_epsilon=1e-6),
    # The pieces mixed otherwise: half the head rotated, SwiGLU with biases, LayerNorm, tied output, plain MHA.
    "rope-half-swiglu-bias": dict(position_embedding_type="rope", rotary_percent=0.5, swiglu=True,
                                  ffn_hidden_size=48, rotary_base=500000),
}
CHUNKS = (1, 2)


def _tp2_body(rank, world_size, variants, references):
    from domino.checkpoint.sharding import shard_state_dict

    state.initialize_model_parallel(2)
    results = {}
    for name, overrides in variants.items():
        full_sd, batch, _ = references[name]
        for chunks in CHUNKS:
            model = build_model(tiny_config(**overrides), VOCAB, chunks, parallel_output=False)
            model.load_state_dict(shard_state_dict(full_sd, rank, 2))
            for masked in (False, True):
                results[(name, chunks, masked)] = logits_losses_grads(model, batch, masked)
    return results


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, overrides in VARIANTS.items():
        torch.manual_seed(11)
        model = GPTModel(tiny_config(**overrides), VOCAB)
        with torch.no_grad():  # non-trivial norm weights and biases, so every mapping matters
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        batch = random_batch(seed=5)
        out[name] = ({k: v.clone() for k, v in model.state_dict().items()}, batch,
                     {masked: logits_losses_grads(model, batch, masked) for masked in (False, True)})
    return out


@pytest.fixture(scope="module")
def tp2_results(references):
    return run_distributed(_tp2_body, 2, VARIANTS, references)


def _compare(got, expected, label):
    logits, losses, grads = got
    assert_close_rel(logits, expected[0], REL, f"{label} logits")
    assert_close_rel(losses, expected[1], REL, f"{label} losses")
    assert grads.keys() == expected[2].keys()
    for name in expected[2]:
        assert_close_rel(grads[name], expected[2][name], REL, f"{label} grad {name}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "reset-positions"])
def test_tp2_matches_unsharded_reference(references, tp2_results, variant, chunks, masked):
    expected = references[variant][2][masked]
    per_rank = [r[(variant, chunks, masked)] for r in tp2_results]
    for rank, (logits, losses, _) in enumerate(per_rank):
        assert_close_rel(logits, expected[0], REL, f"rank {rank} logits")
        assert_close_rel(losses, expected[1], REL, f"rank {rank} losses")
    merged = merge_tp_shards([grads for _, _, grads in per_rank])
    _compare((per_rank[0][0], per_rank[0][1], merged), expected, f"{variant} TP=2 chunks={chunks} masked={masked}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp1_domino_matches_reference(references, variant):
    full_sd, batch, expected = references[variant]
    model = build_model(tiny_config(**VARIANTS[variant]), VOCAB, 2)
    model.load_state_dict(full_sd)
    for masked in (False, True):
        _compare(logits_losses_grads(model, batch, masked), expected[masked],
                 f"{variant} TP=1 chunks=2 masked={masked}")


def test_llama_parameters_are_the_llama_ones():
    sd = GPTModel(tiny_config(**VARIANTS["llama"]), VOCAB).state_dict()
    assert "embedding.position_embeddings.weight" not in sd and "output_layer.weight" in sd
    assert not any(k.endswith("bias") for k in sd)  # no linear biases, and RMSNorm has none
    # GQA: 4 query heads and 2 key/value heads of 8 dims: (4 + 2 x 2) x 8 rows.
    assert sd["layers.0.attention.query_key_value.weight"].shape == (64, 32)
    assert sd["layers.0.mlp.dense_h_to_4h.weight"].shape == (96, 32)  # gate and up rows of 48 inner units
    assert not torch.equal(sd["output_layer.weight"], sd["embedding.word_embeddings.weight"])


def test_positions_matter_through_rope_only():
    """With rope, shifting every position changes nothing (relative), while reordering tokens does."""
    torch.manual_seed(2)
    model = GPTModel(tiny_config(**VARIANTS["llama"], init_method_std=0.3), VOCAB).eval()
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(tokens)
        shifted = model(tokens, position_ids=torch.arange(5, 13).unsqueeze(0))
        reversed_positions = model(tokens, position_ids=torch.arange(7, -1, -1).unsqueeze(0))
    assert_close_rel(shifted, base, 1e-4, "logits with positions shifted by 5")
    assert (reversed_positions - base).abs().max() > 0.1 * base.abs().max()


def test_kv_cache_with_gqa_equals_full_forward():
    torch.manual_seed(4)
    model = GPTModel(tiny_config(**VARIANTS["llama"]), VOCAB).eval()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    cache = model.new_kv_cache()
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :7], kv_cache=cache)] + [model(tokens[:, i:i + 1], kv_cache=cache)
                                                          for i in range(7, 12)]
    assert cache.keys[0].shape == (2, 2, 12, 8)  # only the 2 key/value heads are cached
    assert_close_rel(torch.cat(steps, dim=1), full, 1e-5, "cached decoding vs full forward")
