"""Names read from checkpoints never leave their directory, checkpoints order by number, stale trash goes, and a
refused lock conversion keeps the exclusive lock (issue 36, item 9). Real files, processes and record locks.

- ``domino checkpoint convert --per-tensor`` made a file of every tensor name of an untrusted safetensors header:
  ``../../escaped`` wrote ``escaped.safetensors`` beside the output's parent (reproduced before the fix). Now
  refused in one line naming the file and the name, before anything is written.
- ``iter_10000000`` sorts before ``iter_9999999`` as a string: resume fell back to, and pruning kept, the older one.
- A restart that saves nothing (the run had finished) left the ``.trash-iter_*`` of a save killed while deleting.
- An NFS server without atomic lock conversion (NFS4ERR_LOCK_NOTSUPP, EIO through Linux's client) made the first
  save fail; the claim now keeps its exclusive lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import subprocess
import sys

import pytest
import torch

from train.train_helpers import child_env, run_pretrain

from domino.checkpoint import checkpointing, discovery, leftovers, model_shards
from domino.config import parse_config
from domino.file_lock import try_lock_descriptor

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
    config.checkpoint.load = str(root)
    found, _ = discovery.find_checkpoint(config)
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
    assert sorted(p.name for p in save.iterdir()) == [".save.lock", "iter_0000002", "latest"]


def _held_elsewhere(path) -> bool:
    """Whether another process finds the exclusive lock on ``path`` taken (a forked child tries it)."""
    pid = os.fork()
    if pid == 0:
        descriptor = os.open(path, os.O_RDWR)
        os._exit(0 if try_lock_descriptor(descriptor) else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1


def test_a_refused_lock_conversion_keeps_the_exclusive_lock(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="domino.checkpoint.leftovers")
    root = tmp_path / "ckpt"
    (root / ".tmp-iter_0000003").mkdir(parents=True)
    real = fcntl.lockf

    def nfs_without_conversion(fd, cmd, *rest):
        if cmd == fcntl.LOCK_SH:  # the downgrade of a held exclusive lock: refused as the NFS client reports it
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, cmd, *rest)

    monkeypatch.setattr(leftovers.fcntl, "lockf", nfs_without_conversion)
    claim = leftovers.SaveRootClaim(root)
    assert claim.claim() == [".tmp-iter_0000003"]  # alone: swept, then the exclusive lock kept
    assert "refused to turn the exclusive lock on .save.lock into a shared one" in caplog.text
    assert _held_elsewhere(root / leftovers.LOCK_FILE)  # no other run can sweep while this one lives
    claim.release()
    assert not _held_elsewhere(root / leftovers.LOCK_FILE)

    other = leftovers.SaveRootClaim(root)  # another error is not a refused conversion: raised as before
    monkeypatch.setattr(leftovers.fcntl, "lockf", lambda fd, cmd, *rest: (_ for _ in ()).throw(
        OSError(errno.EBADF, "bad")) if cmd == fcntl.LOCK_SH else real(fd, cmd, *rest))
    with pytest.raises(OSError, match="bad"):
        other.claim()
