"""Exact resume across ranks: a torchrun job whose rank 0 is SIGKILLed halfway through a save restarts from
the previous checkpoint and repeats the killed run's losses bit for bit, for every parallel layout that shards
state differently: TP=2 with Domino chunks (model shards, tensor-parallel RNG streams), DP=2 with ZeRO-1 and
ZeRO-2 (optimizer partitions, data position per replica), and TP=2 x DP=2 (4 processes).

The kill is the real thing: ``DOMINO_FAULT_INJECT=kill-in-save@8`` makes rank 0 send itself SIGKILL after
every rank has written its part of ``iter_0000008`` and before it is renamed into place; torchrun then tears
the other ranks down. Losses after the restart are compared with the killed run's own (uninterrupted)
iterations 5-8, which started from the same in-memory state that checkpoint 4 holds.
"""

from __future__ import annotations

import pytest

from train.train_helpers import read_metrics, run_pretrain, train_losses

BASE = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--train-iters", "8", "--save-interval", "4", "--eval-iters", "0", "--eval-interval", "0",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]

LAYOUTS = {
    "tp2-domino": (2, ["--tensor-model-parallel-size", "2", "--domino-chunks", "2"]),
    "dp2-zero1": (2, ["--zero-stage", "1"]),
    "dp2-zero2": (2, ["--zero-stage", "2"]),
    "tp2xdp2-domino-zero1": (4, ["--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--zero-stage", "1"]),
}


@pytest.mark.timeout(1200)  # two torchrun jobs; generous for a loaded 2-core machine
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sigkill_mid_save_then_restart_repeats_the_losses_bit_for_bit(tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    save = tmp_path / "ckpt"
    args = [*BASE, *flags, "--save", str(save), "--load", str(save)]

    killed = run_pretrain([*args, "--metrics-file", str(tmp_path / "killed.jsonl")], nproc=nproc, check=False,
                          timeout=600, env={"DOMINO_FAULT_INJECT": "kill-in-save@8"})
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert "fault injection: killing this process in kill-in-save at iteration 8" in killed.stderr
    assert (save / "latest").read_text().strip() == "iter_0000004"
    assert [p.is_dir() for p in save.glob(".tmp-iter_0000008.*")] == [True]  # every rank had written its part: the
    # kill was mid-commit (in the killed run's own temporary directory)
    before = train_losses(tmp_path / "killed.jsonl")
    assert sorted(before) == list(range(1, 9))

    run_pretrain([*args, "--metrics-file", str(tmp_path / "resumed.jsonl")], nproc=nproc, timeout=600)
    after = train_losses(tmp_path / "resumed.jsonl")
    assert sorted(after) == [5, 6, 7, 8]  # resumed at checkpoint 4, not from scratch
    assert after == {i: before[i] for i in after}  # exact float equality
    assert read_metrics(tmp_path / "resumed.jsonl")[0]["consumed_samples"] == before_consumed(tmp_path, 5)
    assert (save / "latest").read_text().strip() == "iter_0000008"


def before_consumed(tmp_path, iteration: int) -> int:
    """Samples consumed after ``iteration`` in the killed run."""
    return next(r["consumed_samples"] for r in read_metrics(tmp_path / "killed.jsonl") if r["iteration"] == iteration)
