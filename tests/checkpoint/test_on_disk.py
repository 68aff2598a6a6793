"""The checkpoint format's model-weights part: metadata, shards, latest pointer, clear errors."""

import json

import pytest
import torch

from domino.config import DominoConfig, config_to_dict
from domino.checkpoint import on_disk as wio


def _meta(tp=1, iteration=7):
    return {"iteration": iteration, "consumed_samples": 28, "tensor_model_parallel_size": tp,
            "padded_vocab_size": 64, "tokenizer": "gpt2", "config": config_to_dict(DominoConfig())}


def _write(root, tp=1, iteration=7, tensors=None):
    ckpt = root / wio.checkpoint_tag(iteration)
    tensors = tensors or {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    for rank in range(tp):
        wio.save_model_shard(ckpt, {k: v + rank for k, v in tensors.items()}, rank)
    wio.write_checkpoint_meta(ckpt, _meta(tp, iteration))
    wio.write_latest(root, wio.checkpoint_tag(iteration))
    return ckpt


def test_shard_round_trip_and_meta(tmp_path):
    ckpt = _write(tmp_path, tp=2)
    assert wio.resolve_checkpoint_dir(tmp_path) == ckpt
    assert wio.resolve_checkpoint_dir(ckpt) == ckpt
    meta = wio.read_checkpoint_meta(ckpt)
    assert meta["format_version"] == wio.FORMAT_VERSION and meta["iteration"] == 7
    shards, _ = wio.load_tp_shards(ckpt)
    assert torch.equal(shards[1]["a"], torch.arange(6.0).reshape(2, 3) + 1)
    assert shards[0]["b"].dtype == torch.int64
    assert wio.load_model_shard(ckpt, 1, 2)["b"].tolist() == [2, 2, 2, 2]
    # Only final names remain: no temporary files left behind.
    assert sorted(p.name for p in (ckpt / "model").iterdir()) == ["tp_rank_00.safetensors", "tp_rank_01.safetensors"]


def test_shared_tensors_are_saved(tmp_path):
    weight = torch.randn(4, 3)
    wio.save_model_shard(tmp_path, {"embedding": weight, "output": weight}, 0)
    wio.write_checkpoint_meta(tmp_path, _meta())
    shard = wio.load_model_shard(tmp_path, 0, 1)
    assert torch.equal(shard["embedding"], weight) and torch.equal(shard["output"], weight)


def test_latest_moves_to_newest(tmp_path):
    _write(tmp_path, iteration=5)
    newest = _write(tmp_path, iteration=10)
    assert wio.resolve_checkpoint_dir(tmp_path) == newest
    assert (tmp_path / "latest").read_text().strip() == "iter_0000010"


@pytest.mark.parametrize("setup, message", [
    (lambda root: None, "does not exist"),
    (lambda root: root.mkdir(), "neither checkpoint.json"),
    (lambda root: root.write_text("x"), "is a file"),
    (lambda root: (root.mkdir(), (root / "latest").write_text("iter_0000003\n")), "iter_0000003"),
    (lambda root: (root.mkdir(), (root / "latest").write_text("\x00garbage")), "should name a checkpoint"),
])
def test_bad_paths_have_clear_errors(tmp_path, setup, message):
    root = tmp_path / "ckpt"
    setup(root)
    with pytest.raises(wio.CheckpointError, match=message):
        wio.resolve_checkpoint_dir(root)


def test_bad_meta_and_missing_shard(tmp_path):
    ckpt = _write(tmp_path, tp=2)
    (ckpt / "model" / "tp_rank_01.safetensors").unlink()
    with pytest.raises(wio.CheckpointError, match="tensor_model_parallel_size=2 but lacks .*tp_rank_01"):
        wio.load_tp_shards(ckpt)
    (ckpt / "checkpoint.json").write_text("{not json")
    with pytest.raises(wio.CheckpointError, match="not valid JSON"):
        wio.read_checkpoint_meta(ckpt)
    (ckpt / "checkpoint.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(wio.CheckpointError, match="missing field"):
        wio.read_checkpoint_meta(ckpt)
    with pytest.raises(wio.CheckpointError, match="format_version 9"):
        wio.write_checkpoint_meta(ckpt, {**_meta(), "format_version": 9})


def test_corrupt_shard_is_reported(tmp_path):
    ckpt = _write(tmp_path)
    (ckpt / "model" / "tp_rank_00.safetensors").write_bytes(b"\x80\x03garbage pickle")
    with pytest.raises(wio.CheckpointError, match="not a readable safetensors"):
        wio.load_model_shard(ckpt, 0, 1)


def test_oversized_metadata_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from domino.checkpoint import manifest

    ckpt = _write(tmp_path)
    monkeypatch.setattr(wio, "MAX_META_BYTES", 64)
    with pytest.raises(wio.CheckpointError, match="checkpoint metadata is at most 64 bytes"):
        wio.read_checkpoint_meta(ckpt)
    (ckpt / "manifest.json").write_text('{"format_version": 1, "files": {}}' + " " * 100)
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 64)
    with pytest.raises(ValueError, match="at most 64"):
        manifest.read_manifest(ckpt)
