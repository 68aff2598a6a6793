"""Generation: KV cache equals recomputation, sampling knobs behave, seeds reproduce, EOD stops."""

import pytest
import torch

from domino.config import ConfigError
from domino.eval.generate import generate, generate_ids
from domino.eval.sampling import SamplingConfig, filter_logits, sample_next_token
from eval_checkpoints import tiny_config, tiny_model, tiny_tokenizer

PROMPT = [5, 17, 42, 9]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model(tiny_config(), 100, seed=1)


def test_kv_cache_matches_recomputation(model):
    greedy = generate_ids(model, PROMPT, 20)
    assert len(greedy) == 20 and len(set(greedy)) > 3  # not a degenerate repetition
    assert greedy == generate_ids(model, PROMPT, 20, use_cache=False)
    sampling = SamplingConfig(temperature=1.5, top_k=20, top_p=0.95)
    assert generate_ids(model, PROMPT, 20, sampling, seed=3) == generate_ids(model, PROMPT, 20, sampling, seed=3,
                                                                             use_cache=False)


def test_kv_cache_costs_one_position_per_token(model, monkeypatch):
    widths = []
    original = type(model).forward

    def spy(self, tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    generate_ids(model, PROMPT, 6)
    assert widths == [len(PROMPT)] + [1] * 5


def test_top_k_one_is_greedy_and_seeds_reproduce(model):
    greedy = generate_ids(model, PROMPT, 12)
    assert generate_ids(model, PROMPT, 12, SamplingConfig(top_k=1, temperature=3.0), seed=7) == greedy
    hot = SamplingConfig(temperature=5.0)
    runs = {tuple(generate_ids(model, PROMPT, 12, hot, seed=s)) for s in (1, 2, 3)}
    assert len(runs) == 3  # different seeds differ at this temperature
    assert generate_ids(model, PROMPT, 12, hot, seed=2) == generate_ids(model, PROMPT, 12, hot, seed=2)


def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, False, True, False]]
    # top-p keeps the smallest prefix (by probability) whose mass reaches p: 0.5 + 0.3 >= 0.8
    assert torch.isfinite(filter_logits(logits, top_p=0.8)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.81)).tolist() == [[True, False, True, True]]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).tolist() == [[True, False, False, False]]
    gen = torch.Generator().manual_seed(0)
    draws = [int(sample_next_token(logits, SamplingConfig(top_p=0.8), gen)) for _ in range(200)]
    assert set(draws) == {0, 2}
    counts = [draws.count(0), draws.count(2)]
    assert 0.45 < counts[0] / 200 < 0.80  # renormalised: 0.5 / 0.8 = 0.625
    low = [int(sample_next_token(logits, SamplingConfig(temperature=0.05), gen)) for _ in range(50)]
    assert set(low) == {0}  # a low temperature concentrates on the mode


def test_bad_settings_are_rejected(model):
    for bad, flag in ((SamplingConfig(temperature=0), "--temperature"), (SamplingConfig(top_k=-1), "--top-k"),
                      (SamplingConfig(top_p=0.0), "--top-p")):
        with pytest.raises(ConfigError, match=flag):
            generate_ids(model, PROMPT, 2, bad)
    with pytest.raises(ConfigError, match="exceeds the model's 32 positions"):
        generate_ids(model, PROMPT, 29)
    with pytest.raises(ConfigError, match="prompt is empty"):
        generate_ids(model, [], 2)


def test_generate_stops_at_eod_and_decodes(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    config = tiny_config()
    model = tiny_model(config, tokenizer.vocab_size, seed=2)
    prompt = tokenizer.encode("To be, or not")
    free = generate(model, tokenizer, prompt, 10, stop_at_eod=False)
    assert max(free.token_ids) < tokenizer.vocab_size  # padding ids are never produced
    assert free.text == tokenizer.decode(free.token_ids)
    # Make end-of-document the model's favourite token: generation stops right after it.
    with torch.no_grad():
        model.embedding.word_embeddings.weight[tokenizer.eod] *= 0
        model.final_layernorm.weight.zero_()
        model.final_layernorm.bias.fill_(0.0)
        model.final_layernorm.bias[0] = 1.0
        model.embedding.word_embeddings.weight[tokenizer.eod, 0] = 50.0
    result = generate(model, tokenizer, prompt, 10)
    assert result.token_ids == [tokenizer.eod] and result.stopped_at_eod and result.text == ""
