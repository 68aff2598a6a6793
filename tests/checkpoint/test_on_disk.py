"""The checkpoint format's model-weights part: metadata, shards, latest pointer, clear errors."""

import json

import pytest
import torch

from domino.config import DominoConfig, config_to_dict
from domino.checkpoint import on_disk as wio
from domino.checkpoint import model_shards


def _meta(tp=1, iteration=7):
    return {"iteration": iteration, "consumed_samples": 28, "tensor_model_parallel_size": tp,
            "padded_vocab_size": 64, "tokenizer": "gpt2", "config": config_to_dict(DominoConfig())}


def _write(root, tp=1, iteration=7, tensors=None):
    ckpt = root / wio.checkpoint_tag(iteration)
    tensors = tensors or {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    for rank in range(tp):
        model_shards.save_model_shard(ckpt, {k: v + rank for k, v in tensors.items()}, rank)
    wio.write_checkpoint_meta(ckpt, _meta(tp, iteration))
    wio.write_latest(root, wio.checkpoint_tag(iteration))
    return ckpt


def test_shard_round_trip_and_meta(tmp_path):
    ckpt = _write(tmp_path, tp=2)
    assert wio.resolve_checkpoint_dir(tmp_path) == ckpt
    assert wio.resolve_checkpoint_dir(ckpt) == ckpt
    meta = wio.read_checkpoint_meta(ckpt)
    assert meta["format_version"] == wio.FORMAT_VERSION and meta["iteration"] == 7
    shards, _ = model_shards.load_tp_shards(ckpt)
    assert torch.equal(shards[1]["a"], torch.arange(6.0).reshape(2, 3) + 1)
    assert shards[0]["b"].dtype == torch.int64
    assert model_shards.load_model_shard(ckpt, 1, 2)["b"].tolist() == [2, 2, 2, 2]
    # Only final names remain: no temporary files left behind.
    assert sorted(p.name for p in (ckpt / "model").iterdir()) == ["tp_rank_00.safetensors", "tp_rank_01.safetensors"]


def test_shared_tensors_are_saved(tmp_path):
    weight = torch.randn(4, 3)
    model_shards.save_model_shard(tmp_path, {"embedding": weight, "output": weight}, 0)
    wio.write_checkpoint_meta(tmp_path, _meta())
    shard = model_shards.load_model_shard(tmp_path, 0, 1)
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
        model_shards.load_tp_shards(ckpt)
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
        model_shards.load_model_shard(ckpt, 0, 1)


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


def _write_stages(root, tp=2, stages=2):
    """A checkpoint whose TP ranks' weights are split over stage files: stage s holds layer s, stage 0 the
    embeddings (row-split over TP)."""
    ckpt = root / wio.checkpoint_tag(3)
    for rank in range(tp):
        for stage in range(stages):
            tensors = {f"layers.{stage}.w": torch.full((2,), float(10 * rank + stage))}
            if stage == 0:
                tensors["embedding.word_embeddings.weight"] = torch.full((4, 3), float(rank))
            model_shards.save_model_shard(ckpt, tensors, rank, stage=stage, stages=stages)
    wio.write_checkpoint_meta(ckpt, {**_meta(tp, 3), wio.MODEL_STAGES_KEY: stages})
    return ckpt


def test_stage_files_are_one_slice_per_tp_rank(tmp_path):
    ckpt = _write_stages(tmp_path)
    assert sorted(p.name for p in (ckpt / "model").iterdir()) == [
        f"tp_rank_0{r}_pp_rank_00{s}.safetensors" for r in (0, 1) for s in (0, 1)]
    shards, _ = model_shards.load_tp_shards(ckpt)
    assert sorted(shards[1]) == ["embedding.word_embeddings.weight", "layers.0.w", "layers.1.w"]
    assert shards[1]["layers.1.w"].tolist() == [11.0, 11.0]
    # A reader of some tensors (one stage of another layout) opens only the files that hold them.
    files = model_shards.shard_paths(ckpt)[0]
    assert model_shards.files_holding(files, {"layers.1.w"}) == [files[1]]
    assert sorted(model_shards.load_model_shard(ckpt, 0, 2, names={"layers.1.w"})) == ["layers.1.w"]
    # Another TP size is cut from the joined slices: the embedding rows of both ranks, 8 rows at TP 1.
    whole = model_shards.load_model_shard(ckpt, 0, 1, names={"embedding.word_embeddings.weight"})
    assert whole["embedding.word_embeddings.weight"][:, 0].tolist() == [0.0] * 4 + [1.0] * 4
    with pytest.raises(wio.CheckpointError, match="hold no tensor layers.7.w"):
        model_shards.load_model_shard(ckpt, 0, 2, names={"layers.7.w"})


def test_stage_files_missing_or_overlapping_are_refused(tmp_path):
    ckpt = _write_stages(tmp_path)
    model_shards.save_model_shard(ckpt, {"layers.0.w": torch.zeros(2)}, 1, stage=1, stages=2)  # stage 0's too
    with pytest.raises(wio.CheckpointError, match=r"tp_rank_01_pp_rank_001.safetensors: tensor 'layers.0.w' is "
                                                  r"also stored in .*tp_rank_01_pp_rank_000"):
        model_shards.load_model_shard(ckpt, 1, 2)
    (ckpt / "model" / "tp_rank_00_pp_rank_001.safetensors").unlink()
    with pytest.raises(wio.CheckpointError, match="tensor_model_parallel_size=2 and 2 pipeline stages' files per "
                                                  "rank but lacks .*tp_rank_00_pp_rank_001"):
        model_shards.load_tp_shards(ckpt)
    with pytest.raises(wio.CheckpointError, match="model_stages must be a positive integer"):
        wio.write_checkpoint_meta(ckpt, {**_meta(2, 3), wio.MODEL_STAGES_KEY: 0})
