"""Generation with a KV cache gives the logits of the full sequence."""

from __future__ import annotations

import pytest
import torch

from domino.model import GPTModel
from model_fixtures import VOCAB, assert_close_rel, tiny_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(2)
    return GPTModel(tiny_config(), VOCAB).eval()


def test_one_token_at_a_time_matches_full_sequence(model):
    tokens = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache()
        prompt = model(tokens[:, :4], kv_cache=cache)  # a prompt, then one token per step
        steps = [model(tokens[:, i:i + 1], kv_cache=cache) for i in range(4, 10)]
    assert cache.length == 10
    assert_close_rel(torch.cat([prompt] + steps, dim=1), full, 1e-5, "cached logits")


def test_reorder_keeps_selected_sequences(model):
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_kv_cache()
        model(tokens[:, :5], kv_cache=cache)
        cache.reorder(torch.tensor([1]))
        last = model(tokens[1:, 5:6], kv_cache=cache)
        full = model(tokens[1:])
    assert_close_rel(last, full[:, 5:6], 1e-5, "reordered cache logits")


def test_cache_past_the_position_table_is_rejected(model):
    cache = model.new_kv_cache()
    with torch.no_grad():
        model(torch.zeros(1, 16, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="exceed the model's 16 positions"):
            model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


def test_sequence_longer_than_the_position_table_is_rejected(model):
    with pytest.raises(ValueError, match="17 tokens exceed --max-position-embeddings 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
