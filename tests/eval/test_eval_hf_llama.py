"""LLaMA checkpoints as Hugging Face ``LlamaForCausalLM`` directories: transformers loads the export offline and
agrees with our model (logits, greedy tokens); import brings the weights back; generate and evaluate work on them."""

import json
import math

import pytest
import torch
import transformers

from domino.config import ConfigError
from domino.eval.evaluate import evaluate_checkpoint
from domino.eval.generate import generate_ids
from domino.eval.settings import EvalSettings
from domino.checkpoint.hf_interop import export_hf, import_hf
from domino.checkpoint import on_disk as wio
from domino.checkpoint import model_loading
from eval_checkpoints import run_cli, save_checkpoint, tiny_config, tiny_model, tiny_tokenizer, write_token_dataset

# The tiny LLaMA: rotary positions, SwiGLU, RMSNorm, no biases, GQA (2 key/value heads), untied output.
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
             disable_bias_linear=True, untie_embeddings_and_output_weights=True, group_query_attention=True,
             num_query_groups=2, norm_epsilon=1e-6, rotary_base=20000)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hf-llama")
    tokenizer = tiny_tokenizer(root / "tok")
    config = tiny_config(str(root / "tok"), **LLAMA)
    model = tiny_model(config, tokenizer.vocab_size, seed=8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:  # RMSNorm weights away from 1, so a dropped norm weight would show
                param.add_(torch.randn_like(param) * 0.2)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                param[tokenizer.vocab_size:] = 0.0  # padding rows as import writes them: the losses can then agree
    save_checkpoint(root / "ckpt", model, config, tp=2, tokenizer=tokenizer)  # export must merge TP shards
    return root, model, tokenizer, export_hf(root / "ckpt", root / "hf")


def test_export_is_a_llama_that_transformers_agrees_with(saved, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, model, tokenizer, out = saved
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert isinstance(hf, transformers.LlamaForCausalLM) and hf.config.vocab_size == tokenizer.vocab_size
    tokens = torch.tensor([tokenizer.encode("To be, or not to be, that is the question")])
    with torch.no_grad():
        ours = model(tokens)[..., :tokenizer.vocab_size]
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5 * ours.abs().max().item())
    with torch.no_grad():  # transformers' own generation loop, with its KV cache
        hf_greedy = hf.generate(tokens[:, :4], max_new_tokens=20, do_sample=False, eos_token_id=None,
                                pad_token_id=tokenizer.eod)[0, 4:].tolist()
    ours_greedy = generate_ids(model, tokens[0, :4].tolist(), 20, vocab_size=tokenizer.vocab_size)
    assert hf_greedy == ours_greedy and len(set(ours_greedy)) > 2  # not a degenerate repetition


def test_import_round_trip_generate_and_evaluate(saved, capsys):
    root, model, tokenizer, out = saved
    ckpt = import_hf(out, root / "imported", make_vocab_size_divisible_by=8)
    imported, meta, _ = model_loading.build_model_from_checkpoint(root / "imported")
    assert meta["config"]["model"]["num_query_groups"] == 2 and meta["padded_vocab_size"] == model.vocab_size
    original = model.state_dict()
    assert imported.state_dict().keys() == original.keys()
    for name, tensor in imported.state_dict().items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):  # padding rows come back as zeros
            torch.testing.assert_close(tensor[:tokenizer.vocab_size], original[name][:tokenizer.vocab_size])
            assert not tensor[tokenizer.vocab_size:].any()
        else:
            assert torch.equal(tensor, original[name]), name
    code, stdout, _ = run_cli(["generate", "--load", str(ckpt), "--prompt-ids", "3,4,5", "--max-new-tokens", "8",
                               "--greedy", "--json", "--no-stop-at-eod"], capsys)
    assert code == 0
    assert json.loads(stdout)["token_ids"] == generate_ids(model, [3, 4, 5], 8, vocab_size=tokenizer.vocab_size)
    prefix = write_token_dataset(root / "data" / "corpus", tokenizer.vocab_size, documents=8, eod=tokenizer.eod)
    results = [evaluate_checkpoint(path, prefix, EvalSettings(eval_tokens=None, micro_batch_size=2), seq_length=16,
                                   data_cache_path=str(root / "cache")) for path in (root / "ckpt", ckpt)]
    assert math.isfinite(results[0]["loss"]) and results[0]["tokens"] > 0
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-5)  # TP=2 original == imported


def test_refusals(saved, tmp_path):
    root, _, tokenizer, out = saved
    config = json.loads((out / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (bad / name).write_bytes((out / name).read_bytes())
    (bad / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported .only default and llama3."):
        import_hf(bad, tmp_path / "imp")
    (bad / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(ConfigError, match="k_proj.weight as"):
        import_hf(bad, tmp_path / "imp")
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ConfigError, match="model_type 'mistral' is not one of gpt2, llama"):
        import_hf(bad, tmp_path / "imp")
    assert not (tmp_path / "imp").exists()
    half = tiny_config(tokenizer_spec=str(root / "tok"), **dict(LLAMA, rotary_percent=0.5))
    save_checkpoint(tmp_path / "half", tiny_model(half, tokenizer.vocab_size), half, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match="LlamaForCausalLM rotates whole heads"):
        export_hf(tmp_path / "half", tmp_path / "half-hf")


# Llama 3.1's rope scaling on a head of 16 dimensions at base 10000: the 8 frequencies have wavelengths from 6.3 to
# 2 pi 10^(7/4) = 35,300 positions, so the kept (< 2048), blended (2048-8192) and stretched (> 8192) bands all
# hold some of them.
SCALED = dict(LLAMA, hidden_size=64, num_attention_heads=4, rotary_base=10000, max_position_embeddings=32768,
              use_rope_scaling=True, rope_scaling_factor=8.0)


def test_llama3_rope_scaling_matches_transformers(saved, tmp_path, monkeypatch):
    """Our scaled tables equal transformers' llama3 rope at positions inside and far beyond 8192, an export is a
    rope_type llama3 model with the same logits at such positions, and import reads the scaling back."""
    from domino.model.rotary import RotaryTables

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, _, tokenizer, _ = saved
    config = tiny_config(str(root / "tok"), **SCALED)
    model = tiny_model(config, tokenizer.vocab_size, seed=9, std=0.5)
    with torch.no_grad():
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            model.state_dict()[name][tokenizer.vocab_size:] = 0.0
    save_checkpoint(tmp_path / "ckpt", model, config, tokenizer=tokenizer)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope == {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    positions = torch.tensor([[0, 1, 700, 3000, 9000, 20000, 30000]])
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryTables.for_positions(positions, 16, 10000, torch.float32, scaling_factor=8.0)
    plain = RotaryTables.for_positions(positions, 16, 10000, torch.float32)
    torch.testing.assert_close(ours.cos, cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.sin, sin, rtol=0, atol=1e-5)
    assert (plain.cos - cos).abs().max() > 0.5  # without the scaling the far positions are far off
    tokens = torch.tensor([tokenizer.encode("To be, or not to be, that is the question")])
    far = torch.arange(tokens.shape[1]).unsqueeze(0) + 20000
    with torch.no_grad():
        theirs, ours_logits = hf(tokens, position_ids=far).logits, model(tokens, position_ids=far)
    torch.testing.assert_close(theirs, ours_logits[..., :tokenizer.vocab_size], rtol=1e-4,
                               atol=1e-5 * theirs.abs().max().item())
    imported = import_hf(out, tmp_path / "imported", make_vocab_size_divisible_by=8)
    _, meta, _ = model_loading.build_model_from_checkpoint(imported)
    assert meta["config"]["model"]["use_rope_scaling"] is True and meta["config"]["model"]["rope_scaling_factor"] == 8
    bad = json.loads((out / "config.json").read_text())
    bad["rope_parameters"]["low_freq_factor"] = 2.0
    (out / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="llama3 rope scaling with low_freq_factor 2.0 is not supported"):
        import_hf(out, tmp_path / "imported2")
