"""Our LLaMA-family model equals transformers.LlamaForCausalLM (built offline from its config), same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from domino.config import ConfigError
from domino.model import GPTModel
from domino.model.hf_llama import (from_hf_llama_state_dict, hf_llama_config, model_config_from_hf,
                                   to_hf_llama_state_dict)
from model_fixtures import VOCAB, assert_close_rel, tiny_config

LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
             norm_epsilon=1e-6, max_position_embeddings=32)
VARIANTS = {
    "gqa-untied-no-bias": dict(LLAMA, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
                               group_query_attention=True, num_query_groups=2, rotary_base=500000),
    "mha-tied-biases": dict(LLAMA),
    "mqa": dict(LLAMA, disable_bias_linear=True, group_query_attention=True, num_query_groups=1),
}


def _models(overrides, seed=0):
    config = tiny_config(**overrides)
    torch.manual_seed(seed)
    ours = GPTModel(config, VOCAB).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so every mapping is exercised
        for p in ours.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama_config(config, VOCAB))).eval()
    hf.load_state_dict(to_hf_llama_state_dict(ours.state_dict(), config), strict=True)
    return config, ours, hf


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_llama_for_causal_lm(variant):
    _, ours, hf = _models(VARIANTS[variant])
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert_close_rel(got, expected, 1e-5, f"{variant} logits vs LlamaForCausalLM")


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_exact_and_config_comes_back(variant):
    config, ours, _ = _models(VARIANTS[variant], seed=3)
    sd = ours.state_dict()
    back = from_hf_llama_state_dict(to_hf_llama_state_dict(sd, config), config)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    kwargs = hf_llama_config(config, VOCAB)
    again = model_config_from_hf({"model_type": "llama", **kwargs})
    for field in ("num_layers", "hidden_size", "num_attention_heads", "query_groups", "ffn_size", "rotary_base",
                  "norm_epsilon", "disable_bias_linear", "untie_embeddings_and_output_weights", "num_positions"):
        assert getattr(again, field) == getattr(config, field), field


def test_gqa_rows_map_to_the_heads_of_their_group():
    """Our QKV rows [group, (q_1, q_2, k, v), d]: group 1's second query is HF query head 3, its key is k head 1."""
    config = tiny_config(**VARIANTS["gqa-untied-no-bias"])
    sd = GPTModel(config, VOCAB).state_dict()
    w = sd["layers.0.attention.query_key_value.weight"]  # [2 groups x (2 + 2) x 8, 32]
    hf = to_hf_llama_state_dict(sd, config)
    d = 8
    assert torch.equal(w[(1 * 4 + 1) * d:(1 * 4 + 2) * d], hf["model.layers.0.self_attn.q_proj.weight"][3 * d:4 * d])
    assert torch.equal(w[(1 * 4 + 2) * d:(1 * 4 + 3) * d], hf["model.layers.0.self_attn.k_proj.weight"][d:2 * d])
    fc1 = sd["layers.0.mlp.dense_h_to_4h.weight"]
    assert torch.equal(fc1[2 * 5 + 1], hf["model.layers.0.mlp.up_proj.weight"][5])


def test_clear_errors():
    with pytest.raises(ConfigError, match="LlamaForCausalLM needs --position-embedding-type rope, --swiglu"):
        hf_llama_config(tiny_config(normalization="RMSNorm"), VOCAB)
    with pytest.raises(ConfigError, match="--rotary-percent is 0.5"):
        hf_llama_config(tiny_config(**LLAMA, rotary_percent=0.5), VOCAB)
    with pytest.raises(ConfigError, match="rope type 'dynamic' is not supported"):
        model_config_from_hf({**hf_llama_config(tiny_config(**LLAMA), VOCAB),
                              "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}})
    with pytest.raises(ConfigError, match="llama3 rope scaling without a factor"):
        model_config_from_hf({**hf_llama_config(tiny_config(**LLAMA), VOCAB),
                              "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    config = tiny_config(**VARIANTS["mqa"])
    hf = to_hf_llama_state_dict(GPTModel(config, VOCAB).state_dict(), config)
    with pytest.raises(ConfigError, match="k_proj.weight has shape"):
        from_hf_llama_state_dict(hf, tiny_config(**dict(VARIANTS["mqa"], num_query_groups=2)))
    with pytest.raises(ConfigError, match="more than --num-layers 1"):
        from_hf_llama_state_dict(hf, tiny_config(**dict(VARIANTS["mqa"], num_layers=1)))
