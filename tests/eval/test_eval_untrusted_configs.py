"""Untrusted model configs: every field of an imported ``config.json`` and of a checkpoint's ``checkpoint.json``
is type-checked and bounded before anything is sized by it, and only floating-point weights are imported.

Before: ``n_head = 0`` was a ZeroDivisionError, a negative width a tensor of negative size, a string epsilon a
ValueError, a width of 1e9 a storage-size overflow, a dict for a size a TypeError, ``n_layer = 2.5`` was
truncated to 2 without a word, and integer weights were imported as a model that inspect called intact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from domino.checkpoint import model_loading
from domino.checkpoint import on_disk as wio
from domino.checkpoint.hf_interop import export_hf, import_hf
from domino.config import ConfigError
from eval_checkpoints import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
             disable_bias_linear=True, untie_embeddings_and_output_weights=True, norm_epsilon=1e-6)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A GPT and a LLaMA checkpoint, each with its Hugging Face export."""
    root = tmp_path_factory.mktemp("untrusted")
    for family, extra in (("gpt2", {}), ("llama", LLAMA)):
        tiny_checkpoint(root, f"{family}-ckpt", **extra)
        export_hf(root / f"{family}-ckpt", root / family)
    return root


def _edited(source: Path, target: Path, **fields) -> Path:
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps({**config, **fields}))
    return target


@pytest.mark.parametrize("family, field, value, message", [
    ("gpt2", "n_head", 0, "n_head must be an integer from 1 to 4096, got 0"),
    ("gpt2", "n_embd", -32, "n_embd must be an integer from 1 to 131072, got -32"),
    ("gpt2", "layer_norm_epsilon", "1e-5", "layer_norm_epsilon must be a finite number > 0.0, got '1e-5'"),
    ("gpt2", "n_embd", 10 ** 9, "n_embd must be an integer from 1 to 131072, got 1000000000"),
    ("gpt2", "n_positions", {"a": 1}, "n_positions must be an integer from 1 to 16777216, got {'a': 1}"),
    ("gpt2", "n_layer", 2.5, "n_layer must be an integer from 1 to 4096, got 2.5"),
    ("gpt2", "n_layer", True, "n_layer must be an integer from 1 to 4096, got True"),
    ("gpt2", "attn_pdrop", 1.5, "attn_pdrop must be a finite number >= 0.0 and < 1.0, got 1.5"),
    ("gpt2", "n_head", 5, "--hidden-size 32 is not divisible by --num-attention-heads 5"),
    ("llama", "num_attention_heads", 0, "num_attention_heads must be an integer from 1 to 4096, got 0"),
    ("llama", "intermediate_size", -1, "intermediate_size must be an integer from 1 to 1048576, got -1"),
    ("llama", "rms_norm_eps", "tiny", "rms_norm_eps must be a finite number > 0.0, got 'tiny'"),
    ("llama", "rope_parameters", "yes", "rope_parameters must be an object, got 'yes'"),
    ("llama", "num_hidden_layers", 2.5, "num_hidden_layers must be an integer from 1 to 4096, got 2.5"),
])
def test_each_field_of_an_imported_config_is_typed_and_bounded(exported, tmp_path, family, field, value, message):
    hf_dir = _edited(exported / family, tmp_path / "hf", **{field: value})
    with pytest.raises(ConfigError) as error:
        import_hf(hf_dir, tmp_path / "imported", make_vocab_size_divisible_by=8)
    assert str(error.value) == f"{hf_dir / 'config.json'}: {message}"
    assert not (tmp_path / "imported").exists()


def test_an_integral_float_is_an_integer(exported, tmp_path):
    hf_dir = _edited(exported / "gpt2", tmp_path / "hf", n_layer=2.0)
    ckpt = import_hf(hf_dir, tmp_path / "imported", make_vocab_size_divisible_by=8)
    assert wio.read_checkpoint_meta(ckpt)["config"]["model"]["num_layers"] == 2


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_only_floating_point_weights_are_imported(exported, tmp_path, dtype):
    hf_dir = _edited(exported / "gpt2", tmp_path / "hf")
    tensors = load_file(str(exported / "gpt2" / "model.safetensors"))
    name = "transformer.h.0.attn.c_attn.weight"
    tensors[name] = tensors[name].to(dtype)
    (hf_dir / "model.safetensors").unlink()
    save_file(tensors, str(hf_dir / "model.safetensors"))
    with pytest.raises(ConfigError, match=f"tensor '{name}' has dtype (I64|BOOL); a model's weights are floating"):
        import_hf(hf_dir, tmp_path / "imported", make_vocab_size_divisible_by=8)
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 0, "--num-attention-heads must be >= 1, got 0"),
    ("hidden_size", -32, "--hidden-size must be >= 1, got -32"),
    ("hidden_size", 10 ** 9, "--hidden-size must be <= 131072, got 1000000000"),
    ("norm_epsilon", "1e-5", "setting 'norm_epsilon' must be float, got '1e-5'"),
    ("num_layers", {"a": 1}, "setting 'num_layers' must be int, got {'a': 1}"),
    ("num_layers", 2.5, "setting 'num_layers' must be int, got 2.5"),
])
def test_each_field_of_a_checkpoints_config_is_typed_and_bounded(exported, tmp_path, field, value, message):
    import shutil

    ckpt = shutil.copytree(exported / "gpt2-ckpt", tmp_path / "ckpt") / "iter_0000001"
    meta = json.loads((ckpt / wio.META_FILE).read_text())
    meta["config"]["model"][field] = value
    (ckpt / wio.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(wio.CheckpointError) as error:
        model_loading.build_model_from_checkpoint(ckpt, load_tokenizer=False)
    assert str(error.value).startswith(f"{ckpt / wio.META_FILE}: config: ") and message in str(error.value)


def test_the_command_says_it_in_one_line(exported, tmp_path):
    hf_dir = _edited(exported / "gpt2", tmp_path / "hf", n_head=0)
    proc = subprocess.run([sys.executable, "-m", "domino", "import-hf", "--input", str(hf_dir), "--output",
                           str(tmp_path / "imported")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"domino import-hf: error: {hf_dir / 'config.json'}: n_head must "
                                                    "be an integer from 1 to 4096, got 0")
