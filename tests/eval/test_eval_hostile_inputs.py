"""Untrusted metadata is checked against the bytes on disk before anything it sizes is allocated.

A ``checkpoint.json`` or a Hugging Face ``config.json`` can claim any vocabulary, width, depth or TP size.
Before these checks a claimed vocabulary of 10^10 made ``generate`` try to allocate terabytes, and a claimed
TP size of 30,000,000 built one path per rank; now each ends in a one-line error naming the field.
"""

import json
import time

import pytest
import torch
from safetensors.torch import save_file

from domino.config import ConfigError
from domino.checkpoint.hf_interop import export_hf, import_hf
from domino.checkpoint import on_disk as wio
from domino.checkpoint import model_loading
from eval_checkpoints import run_cli, save_checkpoint, tiny_config, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hostile")
    tokenizer = tiny_tokenizer(root / "tok")
    config = tiny_config(str(root / "tok"))
    model = tiny_model(config, tokenizer.vocab_size, seed=3)
    save_checkpoint(root / "ckpt", model, config, tp=2, tokenizer=tokenizer)
    return root


def _edit_meta(ckpt_root, edit):
    ckpt = wio.resolve_checkpoint_dir(ckpt_root)
    path = ckpt / wio.META_FILE
    original = path.read_text()
    meta = json.loads(original)
    edit(meta)
    path.write_text(json.dumps(meta))
    return path, original


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(padded_vocab_size=10 ** 10), r"padded_vocab_size is 10000000000 but the shards'"),
    (lambda m: m["config"]["model"].update(hidden_size=1 << 16), r"describes .* but the shards hold"),
    (lambda m: m["config"]["model"].update(num_layers=4000), r"num_layers is 4000 but the shards hold 2"),
    (lambda m: m["config"]["model"].update(ffn_hidden_size=1 << 20), r"mlp.dense_4h_to_h.weight as \(32, 1048576\)"),
    (lambda m: m.update(tensor_model_parallel_size=30_000_000),
     r"tensor_model_parallel_size=30000000 but lacks .*tp_rank_02.* more\)"),
])
def test_checkpoint_metadata_is_checked_against_shard_headers(saved, edit, message):
    path, original = _edit_meta(saved / "ckpt", edit)
    try:
        start = time.perf_counter()
        with pytest.raises(wio.CheckpointError, match=message):
            model_loading.build_model_from_checkpoint(saved / "ckpt", load_tokenizer=False)
        assert time.perf_counter() - start < 30  # a bound on the damage, not a speed claim: the old code ran for minutes
        with pytest.raises(wio.CheckpointError, match=message):
            export_hf(saved / "ckpt", saved / "never-written")
        assert not (saved / "never-written").exists()
    finally:
        path.write_text(original)
    model, meta, _ = model_loading.build_model_from_checkpoint(saved / "ckpt", load_tokenizer=False)
    assert meta["tensor_model_parallel_size"] == 2 and model.vocab_size == meta["padded_vocab_size"]


def test_generate_reports_a_lying_checkpoint_in_one_line(saved, capsys):
    path, original = _edit_meta(saved / "ckpt", lambda m: m.update(padded_vocab_size=10 ** 10))
    try:
        code, _, err = run_cli(["generate", "--load", str(saved / "ckpt"), "--prompt", "To be",
                                "--max-new-tokens", "2"], capsys)
    finally:
        path.write_text(original)
    assert code != 0
    last = err.strip().splitlines()[-1]  # the CLI's own line (a logging handler of an earlier test may add noise)
    assert last.startswith("domino generate: error: ") and "padded_vocab_size is 10000000000" in last


@pytest.fixture()
def hf_dir(saved, tmp_path):
    return export_hf(saved / "ckpt", tmp_path / "hf")


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 10 ** 9, r"config.json describes transformer.wte.weight as \(1000000000, 32\)"),
    ("n_embd", 1 << 16, r"config.json describes transformer.wte.weight"),
    ("n_positions", 1 << 24, r"transformer.wpe.weight as \(16777216, 32\)"),
    ("n_layer", 4000, r"n_layer is 4000 but the weights hold 2 layers"),
])
def test_hf_config_is_checked_against_the_weights(hf_dir, tmp_path, field, value, message):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConfigError, match=message):
        import_hf(hf_dir, tmp_path / "imported", make_vocab_size_divisible_by=8)
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("entry", ["../victim.safetensors", "/etc/passwd", "sub/dir.safetensors", ".."])
def test_weight_map_entries_stay_inside_the_input_folder(hf_dir, tmp_path, entry):
    (hf_dir / "model.safetensors").rename(tmp_path / "victim.safetensors")
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"transformer.wte.weight": entry}}))
    with pytest.raises(ConfigError, match="is not a file name inside"):
        import_hf(hf_dir, tmp_path / "imported", make_vocab_size_divisible_by=8)


def test_malformed_weight_index_is_one_line(hf_dir, tmp_path):
    (hf_dir / "model.safetensors").unlink()
    (hf_dir / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a safetensors index with a weight_map"):
        import_hf(hf_dir, tmp_path / "imported", make_vocab_size_divisible_by=8)


def test_weights_shard_index_still_imports(hf_dir, tmp_path):
    from safetensors.torch import load_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    (hf_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, str(hf_dir / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(hf_dir / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if i < half else 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = import_hf(hf_dir, tmp_path / "imported", make_vocab_size_divisible_by=8)
    assert wio.read_checkpoint_meta(ckpt)["tensor_model_parallel_size"] == 1


def test_overwrite_never_touches_a_users_sibling_folder(hf_dir, tmp_path):
    output = tmp_path / "imported"
    import_hf(hf_dir, output, make_vocab_size_divisible_by=8)
    sibling = tmp_path / "imported.old"  # the name the previous backup scheme used, and then deleted
    sibling.mkdir()
    (sibling / "precious.txt").write_text("mine")
    import_hf(hf_dir, output, make_vocab_size_divisible_by=8, overwrite=True)
    assert (sibling / "precious.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "imported", "imported.old"]
