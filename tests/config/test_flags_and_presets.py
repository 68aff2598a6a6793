"""Megatron-style flags, presets as data, and validation messages that name the flags."""

import dataclasses

import pytest

from domino.config import ConfigError, DominoConfig, config_from_dict, config_to_dict, padded_vocab_size, parse_config
from domino.config import preset_store
from domino.config.flags import config_to_argv, field_docs
from domino.config.schema import CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, TrainConfig

SEED_FLAGS = ["--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
              "--max-position-embeddings", "--vocab-size", "--hidden-dropout", "--attention-dropout",
              "--init-method-std", "--tensor-model-parallel-size", "--micro-batch-size", "--global-batch-size",
              "--seed", "--fp16", "--bf16", "--domino-chunks"]


@pytest.mark.parametrize("cls", [ModelConfig, ParallelConfig, TrainConfig, DataConfig, CheckpointConfig, LoggingConfig])
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing


def test_seed_flags_exist_and_parse():
    import argparse

    from domino.config import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    known = {opt for action in parser._actions for opt in action.option_strings}
    assert set(SEED_FLAGS) <= known
    config = parse_config(["--num-layers", "3", "--hidden-size", "96", "--num-attention-heads", "6", "--seq-length",
                           "32", "--vocab-size", "1000", "--hidden-dropout", "0.2", "--bf16", "--domino-chunks", "2"])
    assert (config.model.num_layers, config.model.hidden_size, config.model.num_attention_heads) == (3, 96, 6)
    assert config.model.hidden_dropout == 0.2 and config.train.bf16 and config.parallel.domino_chunks == 2
    assert config.model.ffn_size == 384 and config.model.num_positions == 32


def test_preset_then_explicit_flag_overrides():
    config = parse_config(["--preset", "gpt3-6.7b", "--num-layers", "4", "--no-bf16", "--tensor-model-parallel-size", "2"])
    assert config.preset == "gpt3-6.7b"
    assert (config.model.hidden_size, config.model.num_attention_heads, config.model.num_layers) == (4096, 32, 4)
    assert config.train.bf16 is False and config.parallel.tensor_model_parallel_size == 2


@pytest.mark.parametrize("name", preset_store.available())
def test_every_preset_is_valid(name):
    config = parse_config(["--preset", name])
    assert config.model.hidden_size % config.model.num_attention_heads == 0


def test_required_presets_ship():
    assert {"tiny", "gpt2-125m", "gpt3-350m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b"} <= set(
        preset_store.available())
    big = parse_config(["--preset", "gpt3-13b"]).model
    assert (big.num_layers, big.hidden_size, big.num_attention_heads, big.seq_length) == (40, 5120, 64, 1024)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'gpt9'.*tiny"):
        parse_config(["--preset", "gpt9"])


@pytest.mark.parametrize("argv, message", [
    (["--num-attention-heads", "10", "--hidden-size", "80", "--tensor-model-parallel-size", "4"],
     "--num-attention-heads 10 is not divisible by --tensor-model-parallel-size 4"),
    (["--hidden-size", "100", "--num-attention-heads", "3"], "--hidden-size 100 is not divisible by --num-attention-heads 3"),
    (["--domino-chunks", "0"], "--domino-chunks must be >= 1"),
    (["--micro-batch-size", "3", "--domino-chunks", "2"], "--micro-batch-size 3 is not divisible by --domino-chunks 2"),
    (["--fp16", "--bf16"], "--fp16 and --bf16 are mutually exclusive"),
    (["--zero-stage", "3"], "--zero-stage must be 0, 1 or 2"),
    (["--seq-length", "128", "--max-position-embeddings", "64"], "--max-position-embeddings 64 is smaller"),
    (["--lr-decay-style", "exp"], "--lr-decay-style must be one of constant, linear, cosine, inverse-square-root, WSD"),
])
def test_invalid_configs_fail_with_flag_names(argv, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        parse_config(argv)


def test_world_size_checks():
    with pytest.raises(ConfigError, match="world size 3 is not divisible by --tensor-model-parallel-size 2"):
        parse_config(["--tensor-model-parallel-size", "2"], world_size=3)
    with pytest.raises(ConfigError, match="--global-batch-size 10 is not divisible by --micro-batch-size 4 x data-parallel size 2"):
        parse_config(["--global-batch-size", "10", "--micro-batch-size", "4"], world_size=2)
    parse_config(["--global-batch-size", "16", "--micro-batch-size", "4"], world_size=2)


def test_round_trips():
    config = parse_config(["--preset", "tiny", "--data-path", "0.3", "a", "0.7", "b", "--mmap-warmup", "--zero-stage", "2"])
    assert config_from_dict(config_to_dict(config)) == config
    again = parse_config(["--preset", "tiny", *config_to_argv(config)])
    assert dataclasses.replace(again, preset=config.preset) == config


def test_unknown_key_in_saved_config_is_named():
    with pytest.raises(ConfigError, match="unknown setting 'num_layerz'"):
        config_from_dict({"model": {"num_layerz": 2}})


def test_padded_vocab_follows_megatron():
    config = DominoConfig()
    assert padded_vocab_size(50257, config) == 50304
    config = config.replace(tensor_model_parallel_size=2)
    assert padded_vocab_size(50257, config) == 50432


def test_llama_presets_have_their_published_shapes():
    """Hugging Face config.json values of meta-llama/Llama-2-7b-hf, Llama-2-13b-hf and Meta-Llama-3-8B."""
    shapes = {}
    for name in ("llama2-7b", "llama2-13b", "llama3-8b"):
        m = parse_config(["--preset", name]).model
        shapes[name] = (m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size,
                        m.max_position_embeddings, m.vocab_size, m.rotary_base, m.norm_epsilon)
        assert m.rope and m.normalization == "RMSNorm" and m.swiglu and m.disable_bias_linear
        assert m.untie_embeddings_and_output_weights
    assert shapes == {"llama2-7b": (32, 4096, 32, 32, 11008, 4096, 32000, 10000, 1e-5),
                      "llama2-13b": (40, 5120, 40, 40, 13824, 4096, 32000, 10000, 1e-5),
                      "llama3-8b": (32, 4096, 32, 8, 14336, 8192, 128256, 500000, 1e-5)}
    llama31 = parse_config(["--preset", "llama3.1-8b"]).model  # meta-llama/Llama-3.1-8B: Llama 3's shape, longer rope
    assert (llama31.max_position_embeddings, llama31.use_rope_scaling, llama31.rope_scaling_factor) == (131072, True, 8)
    assert [getattr(llama31, f) for f in ("num_layers", "hidden_size", "ffn_size", "query_groups", "rotary_base")] == \
        [32, 4096, 14336, 8, 500000]
    tiny = parse_config(["--preset", "tiny-llama", "--tensor-model-parallel-size", "2"], world_size=2).model
    assert tiny.group_query_attention and tiny.query_groups == 2 and tiny.rope


def test_older_spellings_of_llama_flags():
    config = parse_config(["--layernorm-epsilon", "1e-6", "--use-rotary-position-embeddings"])
    assert config.model.norm_epsilon == 1e-6 and config.model.rope
    assert parse_config(["--norm-epsilon", "2e-6"]).model.norm_epsilon == 2e-6
    # Configs stored in checkpoints before the rename still load.
    stored = config_to_dict(DominoConfig())
    del stored["model"]["norm_epsilon"]
    stored["model"]["layernorm_epsilon"] = 3e-6
    assert config_from_dict(stored).model.norm_epsilon == 3e-6


def test_swiglu_ffn_default_is_megatrons():
    """Megatron-LM validate_args: int((4 h 2 / 3) / 64) x 64 with --swiglu (h=4096: 10880), 4 h without."""
    assert parse_config(["--hidden-size", "4096", "--num-attention-heads", "32", "--swiglu"]).model.ffn_size == 10880
    assert parse_config(["--hidden-size", "4096", "--num-attention-heads", "32"]).model.ffn_size == 16384
    m = parse_config(["--swiglu", "--ffn-hidden-size", "11008", "--hidden-size", "4096",
                      "--num-attention-heads", "32"]).model
    assert m.ffn_size == 11008  # given explicitly, kept (DeepSpeed-Domino's parser would overwrite it)
    assert m.query_groups == 32  # without --group-query-attention every head has its own key/value head



def test_every_flags_help_renders_its_docstring_whole():
    """argparse formats help with %: a field docstring's "10%" must come out as written, not as argparse's dump of
    the action (the --log-straggler help did before its docstring's % was escaped)."""
    import contextlib
    import io

    from domino.cli.main import build_parser

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
        build_parser().parse_args(["pretrain", "--help"])
    out = " ".join(buffer.getvalue().split())
    assert "more than 10% slower than the median" in out and "'option_strings'" not in out
