"""Names read from checkpoints never leave their directory, checkpoints order by number, and stale trash goes
(issue 36, item 9). Real files and processes.

- ``domino checkpoint convert --per-tensor`` made a file of every tensor name of an untrusted safetensors header:
  ``../../escaped`` wrote ``escaped.safetensors`` beside the output's parent (reproduced before the fix). Now
  refused in one line naming the file and the name, before anything is written.
- ``iter_10000000`` sorts before ``iter_9999999`` as a string: resume fell back to, and pruning kept, the older one.
- A restart that saves nothing (the run had finished) left the ``.trash-iter_*`` of a save killed while deleting.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from train.train_helpers import child_env, run_pretrain

from domino.checkpoint import checkpointing, discovery, model_shards
from domino.config import parse_config

TINY = ["--preset", "tiny", "--vocab-size", "256", "--num-layers", "1"]


def _weights(config) -> dict:
    from domino.model.gpt_model import GPTModel

    return {k: v.detach().clone() for k, v in GPTModel(config.model, 256).state_dict().items()}


def test_convert_per_tensor_refuses_a_name_that_would_leave_the_output(tmp_path):
    config = parse_config(TINY)
    weights = _weights(config)
    weights["../../escaped"] = torch.zeros(2)  # what a crafted header can hold
    ckpt = model_shards.write_weights_only_checkpoint(tmp_path / "deep" / "root", config, weights, 256)
    output = tmp_path / "deep" / "out" / "tensors"
    proc = subprocess.run([sys.executable, "-m", "domino", "checkpoint", "convert", "--load", str(ckpt), "--output",
                           str(output), "--per-tensor"], env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"{ckpt / 'model'}: tensor name '../../escaped' cannot be a file name" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not output.exists()
    assert not list(tmp_path.rglob("escaped*")) and not (tmp_path / "deep" / "out").exists()


def test_checkpoints_past_ten_million_iterations_order_by_number(tmp_path):
    config = parse_config(TINY)
    root = tmp_path / "root"
    for iteration in (9_999_999, 10_000_000):
        model_shards.write_weights_only_checkpoint(root, config, _weights(config), 256, iteration=iteration)
    checkpointing._prune(root, 2, keep="iter_10000000", iteration=10_000_000)
    assert len([p for p in root.iterdir() if p.name.startswith("iter_")]) == 2
    # `latest` names a missing checkpoint and the newest is incomplete: resume takes the one below it, 9,999,999
    # (as a string it is above "iter_10000001" and was passed over).
    (root / "latest").write_text("iter_10000001\n")
    os.replace(root / "iter_10000000" / "checkpoint.json", tmp_path / "aside.json")
    found, _ = discovery.find_checkpoint(config.replace(load=str(root)))
    assert found.path.name == "iter_9999999"
    os.replace(tmp_path / "aside.json", root / "iter_10000000" / "checkpoint.json")
    checkpointing._prune(root, 1, keep="iter_10000000", iteration=10_000_000)
    # Pruning to one keeps the newest; as strings the newest sorted first and both stayed.
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == ["iter_10000000"]


def test_a_restart_that_saves_nothing_sweeps_the_trash(tmp_path):
    save = tmp_path / "ckpt"
    args = [*TINY, "--mock-data", "--train-iters", "2", "--eval-iters", "0", "--eval-interval", "0",
            "--num-workers", "0", "--save", str(save), "--load", str(save)]
    run_pretrain(args)
    (save / ".trash-iter_0000002" / "model").mkdir(parents=True)  # a save killed while deleting the replaced copy
    (save / ".trash-iter_0000002" / "model" / "tp_rank_00.safetensors").write_bytes(b"old")
    again = run_pretrain(args)
    assert "nothing left to train at iteration 2 of 2" in again.stderr
    assert "removed .trash-iter_0000002 from" in again.stderr, again.stderr[-3000:]
    assert sorted(p.name for p in save.iterdir()) == [".save.lock", ".save.lock.json", "goodput.jsonl", "iter_0000002",
                                                      "latest"]

