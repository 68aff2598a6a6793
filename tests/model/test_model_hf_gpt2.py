"""Our GPT equals transformers.GPT2LMHeadModel (built offline) when given the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from domino.config import ConfigError
from domino.model import GPTModel
from domino.model.hf_gpt2 import from_hf_gpt2_state_dict, hf_gpt2_config, to_hf_gpt2_state_dict
from model_fixtures import VOCAB, assert_close_rel, tiny_config


@pytest.mark.parametrize("ffn", [None, 48], ids=["ffn-4h", "ffn-48"])
def test_logits_match_gpt2_lm_head_model(ffn):
    config = tiny_config(ffn_hidden_size=ffn)
    torch.manual_seed(0)
    ours = GPTModel(config, VOCAB).eval()
    with torch.no_grad():  # non-zero biases and LayerNorm affine, so every mapping is exercised
        for p in ours.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_gpt2_config(config, VOCAB))).eval()
    missing, unexpected = hf.load_state_dict(to_hf_gpt2_state_dict(ours.state_dict(), config), strict=False)
    assert not unexpected and all(k.endswith(("attn.bias", "attn.masked_bias")) for k in missing), missing
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert_close_rel(got, expected, 1e-4, "logits vs GPT2LMHeadModel")


def test_round_trip_is_exact():
    config = tiny_config()
    torch.manual_seed(1)
    sd = GPTModel(config, VOCAB).state_dict()
    back = from_hf_gpt2_state_dict(to_hf_gpt2_state_dict(sd, config), config)
    assert back.keys() == sd.keys()
    for name in sd:
        assert torch.equal(back[name], sd[name]), name


def test_qkv_maps_heads_to_hf_blocks():
    """HF c_attn columns are [q | k | v]; our rows are per head [q, k, v]."""
    config = tiny_config()
    sd = GPTModel(config, VOCAB).state_dict()
    w = sd["layers.0.attention.query_key_value.weight"]  # [heads * 3 * d, h], d = 8
    hf_w = to_hf_gpt2_state_dict(sd, config)["transformer.h.0.attn.c_attn.weight"]  # [h, 3h]
    d, h = 8, 32
    head, part = 2, 1  # the key of head 2
    ours_rows = w[(head * 3 + part) * d:(head * 3 + part + 1) * d]
    hf_cols = hf_w[:, part * h + head * d:part * h + (head + 1) * d]
    assert torch.equal(ours_rows, hf_cols.t())


def test_config_kwargs_and_clear_errors():
    kwargs = hf_gpt2_config(tiny_config(), VOCAB)
    assert kwargs["activation_function"] == "gelu" and kwargs["n_positions"] == 16 and kwargs["n_inner"] is None
    assert kwargs["eos_token_id"] is None  # GPT-2's 50256 does not fit a 64-token vocabulary
    with pytest.raises(ConfigError, match="divisible by --num-attention-heads"):
        hf_gpt2_config(tiny_config(hidden_size=30), VOCAB)
    sd = to_hf_gpt2_state_dict(GPTModel(tiny_config(), VOCAB).state_dict(), tiny_config())
    with pytest.raises(ConfigError, match="more than --num-layers 1"):
        from_hf_gpt2_state_dict(sd, tiny_config(num_layers=1))
    with pytest.raises(ConfigError, match="c_attn.weight has shape"):
        from_hf_gpt2_state_dict(sd, tiny_config(hidden_size=16))
    del sd["transformer.ln_f.bias"]
    with pytest.raises(ConfigError, match="transformer.ln_f.bias"):
        from_hf_gpt2_state_dict(sd, tiny_config())
