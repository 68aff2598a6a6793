"""Verified checkpoints: every file's size and CRC-32 recorded at save, checked before use, with fallback.

A damaged latest checkpoint must not crash-loop a job that the operator restarts: the run falls back to
the newest intact checkpoint with a loud warning (``--strict-load`` refuses instead), and with several ranks
all of them agree on the same outcome even when only one rank's file is damaged.
"""

import json
from pathlib import Path

import pytest

from domino.checkpoint import manifest
from train.train_helpers import TINY, run_pretrain, train_losses


def _flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))  # same size: only the checksum can tell


def test_manifest_records_and_detects(tmp_path):
    (tmp_path / "model").mkdir()
    shard, meta = tmp_path / "model" / "a.bin", tmp_path / "checkpoint.json"
    shard.write_bytes(b"x" * 1000)
    meta.write_text("{}")
    manifest.write_part(tmp_path, 0, [shard])
    manifest.seal(tmp_path)
    files = manifest.read_manifest(tmp_path)
    assert set(files) == {"model/a.bin", "checkpoint.json"} and files["model/a.bin"]["size"] == 1000
    assert not (tmp_path / manifest.PARTS_DIR).exists()
    assert manifest.find_damage(tmp_path) is None and manifest.verify(tmp_path, files) is None

    _flip_byte(shard)
    assert manifest.find_damage(tmp_path) is None  # sizes alone cannot see a flipped byte
    assert "a.bin is damaged" in manifest.verify(tmp_path, ["model/a.bin"])
    assert manifest.verify(tmp_path, ["checkpoint.json"]) is None  # only the named files are read
    shard.write_bytes(b"x" * 10)
    assert "has 10 bytes, the manifest says 1000" in manifest.find_damage(tmp_path)
    shard.unlink()
    assert "a.bin is missing" in manifest.find_damage(tmp_path)


@pytest.mark.parametrize("content", ["{", json.dumps({"format_version": 1, "files": {"../../etc/x": {
    "size": 1, "crc32": 1}}}), json.dumps({"format_version": 9, "files": {}})])
def test_a_bad_manifest_is_damage_not_a_crash(tmp_path, content):
    (tmp_path / manifest.MANIFEST_FILE).write_text(content)
    assert "is not a checkpoint manifest" in manifest.find_damage(tmp_path)


#: The optimizer state's files: DCP names the one rank r writes shard-{r+1:05d}-... (each rank verifies every
#: world-size-th of them when loading: rank 1 of 2 the second).
SHARD = "shard-{:05d}-model-00001-of-00001.safetensors"


def _args(prefix, save, metrics, iters, *extra):
    # A fixed decay length: a run of 4 iterations continued to 6 keeps its learning-rate schedule.
    return [*TINY, "--data-path", prefix, "--train-iters", str(iters), "--lr-decay-iters", "6", "--save-interval",
            "2", "--save", str(save), "--load", str(save), "--metrics-file", str(metrics), "--eval-iters", "0",
            "--eval-interval", "0", *extra]


def test_damaged_latest_falls_back_to_the_newest_intact_checkpoint(tmp_path, corpus_prefix):
    save, first = tmp_path / "ckpt", tmp_path / "first.jsonl"
    run_pretrain(_args(corpus_prefix, save, first, 4))
    files = manifest.read_manifest(save / "iter_0000004")
    assert {"checkpoint.json", "model/tp_rank_00.safetensors", f"optimizer/{SHARD.format(1)}",
            "rng/rank_00000.pt"} <= set(files)
    _flip_byte(save / "iter_0000004" / "optimizer" / SHARD.format(1))

    strict = run_pretrain(_args(corpus_prefix, save, tmp_path / "strict.jsonl", 6, "--strict-load"), check=False)
    assert strict.returncode != 0 and "Traceback" not in strict.stderr
    assert "iter_0000004 is damaged" in strict.stderr and "--strict-load refuses" in strict.stderr

    resumed = tmp_path / "resumed.jsonl"
    proc = run_pretrain(_args(corpus_prefix, save, resumed, 6))
    assert "CHECKPOINT" in proc.stderr and f"{SHARD.format(1)} is damaged" in proc.stderr
    assert "iter_0000002" in proc.stderr
    losses, reference = train_losses(resumed), train_losses(first)
    assert sorted(losses) == [3, 4, 5, 6]  # resumed after iteration 2, not 4
    assert losses[3] == reference[3] and losses[4] == reference[4]  # bit-exact from the intact checkpoint
    assert (save / "latest").read_text().strip() == "iter_0000006"


def test_torn_latest_is_skipped_when_choosing(tmp_path, corpus_prefix):
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run_pretrain(_args(corpus_prefix, save, metrics, 4))
    (save / "iter_0000004" / "model" / "tp_rank_00.safetensors").write_bytes(b"torn")
    (save / "iter_0000004" / "checkpoint.json").unlink()
    proc = run_pretrain(_args(corpus_prefix, save, tmp_path / "again.jsonl", 4))
    assert "IS DAMAGED" in proc.stderr and "iter_0000002" in proc.stderr
    assert sorted(train_losses(tmp_path / "again.jsonl")) == [3, 4]


def test_ranks_agree_when_only_one_ranks_file_is_damaged(tmp_path, corpus_prefix):
    """DP=2: only the optimizer file rank 1 verifies is damaged; both ranks fall back to the same checkpoint."""
    save, first = tmp_path / "ckpt", tmp_path / "first.jsonl"
    run_pretrain(_args(corpus_prefix, save, first, 4, "--zero-stage", "1"), nproc=2)
    _flip_byte(save / "iter_0000004" / "optimizer" / SHARD.format(2))
    resumed = tmp_path / "resumed.jsonl"
    proc = run_pretrain(_args(corpus_prefix, save, resumed, 6, "--zero-stage", "1"), nproc=2)
    assert "rank 1 (node " in proc.stderr and f"{SHARD.format(2)} is damaged" in proc.stderr
    losses, reference = train_losses(resumed), train_losses(first)
    assert sorted(losses) == [3, 4, 5, 6]
    assert losses[3] == reference[3] and losses[4] == reference[4]
