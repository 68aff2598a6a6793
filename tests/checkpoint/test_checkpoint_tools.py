"""``domino checkpoint inspect`` and ``domino checkpoint convert`` on a real checkpoint of a one-process run."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from train.train_helpers import run_pretrain

from domino.checkpoint import distributed_io, fragment_io, model_shards, sharding
from domino.checkpoint.on_disk import Checkpoint

ARGS = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--train-iters", "2", "--eval-iters", "0", "--eval-interval", "0", "--zero-stage", "1"]


@pytest.fixture
def domino(capsys):
    """``domino checkpoint ARGS`` in this process (no interpreter start per call), as a completed process."""
    from domino.cli.main import main

    def run(*args) -> subprocess.CompletedProcess:
        with pytest.raises(SystemExit) as done:
            main(["checkpoint", *args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["domino", "checkpoint", *args], done.value.code or 0, out.out, out.err)
    return run


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools") / "ckpt"
    run_pretrain([*ARGS, "--save", str(root)], timeout=300)
    return root


def test_inspect_reports_the_checkpoint_and_finds_a_flipped_byte(saved, tmp_path, domino):
    proc = domino("inspect", "--load", str(saved), "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout)
    assert (found["iteration"], found["format_version"], found["optimizer"]) == (2, 2, "by-name")
    assert found["layout"]["TP"] == 1 and found["layout"]["ZeRO"] == 1
    assert found["integrity"].startswith("intact") and found["bytes_by_part"]["optimizer"] > 0
    assert any("tensor-model-parallel size 1, 2, 4" in line for line in found["resumable_on"]), found

    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    target = distributed_io.files(damaged / "iter_0000002" / "optimizer")[0]
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    proc = domino("inspect", "--load", str(damaged), "--no-progress")
    assert proc.returncode == 1 and "integrity: DAMAGED:" in proc.stdout and target.name in proc.stdout


def test_convert_cuts_the_model_for_another_tp_size_and_writes_one_file_per_tensor(saved, tmp_path, domino):
    proc = domino("convert", "--load", str(saved), "--tensor-model-parallel-size", "2",
                   "--output", str(tmp_path / "tp2"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    full = model_shards.load_full_state_dict(saved / "iter_0000002")
    shards, meta = model_shards.load_tp_shards(tmp_path / "tp2" / "iter_0000002")
    assert meta["tensor_model_parallel_size"] == 2 and meta["config"]["model"]["make_vocab_size_divisible_by"] == 64
    for rank, shard in enumerate(shards):
        expected = sharding.shard_state_dict(full, rank, 2)
        assert sorted(shard) == sorted(expected) and all(torch.equal(shard[k], expected[k]) for k in shard)
    # Its own manifest holds.
    assert domino("inspect", "--load", str(tmp_path / "tp2"), "--no-progress").returncode == 0

    proc = domino("convert", "--load", str(saved), "--per-tensor", "--output", str(tmp_path / "flat"),
                   "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    optimizer = fragment_io.read_state(Checkpoint.read(saved / "iter_0000002"))
    index = json.loads((tmp_path / "flat" / "index.json").read_text())["tensors"]
    assert len(index) == len(full) + len(optimizer)
    name = "exp_avg_sq.layers.0.attention.query_key_value.weight"
    assert torch.equal(load_file(str(tmp_path / "flat" / "optimizer" / f"{name}.safetensors"))[name], optimizer[name])

    again = domino("convert", "--load", str(saved), "--per-tensor", "--output", str(tmp_path / "flat"))
    assert again.returncode == 2 and "is not empty" in again.stderr
