"""The learning-rate schedule and batch ramp are stored in every checkpoint and checked on resume (issue 36, item 4).

Real one-process `domino pretrain` runs: a resume with another ``--lr`` or ``--train-iters`` (the decay length it
sets) or without the checkpoint's ``--rampup-batch-size`` stops before training in one line naming both values and
Megatron's two flags; ``--use-checkpoint-opt_param-scheduler`` continues the checkpoint's schedule (the learning
rates and losses of the uninterrupted run, exactly: the same layout), ``--override-opt_param-scheduler`` takes the
run's and says so; a checkpoint saved before the record (its ``schedule`` field removed) still resumes; a
constant rate, which no decay length changes, may be extended past its ``--train-iters``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.train_helpers import read_metrics, run_pretrain

RUN = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
       "--seed", "7", "--eval-iters", "0", "--eval-interval", "0", "--hidden-dropout", "0", "--attention-dropout",
       "0", "--global-batch-size", "8", "--lr", "2.5e-4", "--min-lr", "2.5e-5", "--num-layers", "1"]
ITERS = ["--train-iters", "4"]


def _records(path: Path) -> dict:
    return {r["iteration"]: (r["lr"], r["lm_loss"]) for r in read_metrics(path) if "lm_loss" in r and "eval" not in r}


def _refused(flags, needle: str) -> None:
    proc = run_pretrain(flags, check=False, timeout=300)
    assert proc.returncode != 0 and needle in proc.stderr, proc.stderr[-3000:]
    assert "--use-checkpoint-opt_param-scheduler to take them or --override-opt_param-scheduler" in proc.stderr
    assert "iteration " not in proc.stderr  # refused before any step


@pytest.mark.timeout(600)
def test_a_changed_schedule_is_refused_naming_both_values_and_the_two_flags_take_either(tmp_path):
    save = tmp_path / "run"
    run_pretrain([*RUN, *ITERS, "--save", str(save), "--save-interval", "2", "--metrics-file",
                  str(tmp_path / "reference.jsonl")], timeout=300)
    reference = _records(tmp_path / "reference.jsonl")
    ckpt = save / "iter_0000002"
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert meta["schedule"]["lr"]["max_lr"] == 2.5e-4 and meta["schedule"]["train_iters"] == 4

    load = ["--load", str(ckpt)]
    _refused([*RUN, *ITERS, "--lr", "2.5e-3", *load], "(--lr: checkpoint 0.00025 vs run 0.0025)")
    _refused([*RUN, "--train-iters", "8", *load],
             "decay samples (--lr-decay-*, else --train-iters / --train-samples): checkpoint 32 vs run 64")

    # The checkpoint's schedule: the uninterrupted run's learning rates and losses, exactly.
    metrics = tmp_path / "kept.jsonl"
    proc = run_pretrain([*RUN, *ITERS, "--lr", "2.5e-3", "--use-checkpoint-opt_param-scheduler", *load,
                         "--metrics-file", str(metrics)], timeout=300)
    assert "--use-checkpoint-opt_param-scheduler: the checkpoint's schedule replaces this run's (--lr: " in proc.stderr
    assert _records(metrics) == {i: reference[i] for i in (3, 4)}

    # This run's schedule: a tenfold rate from iteration 3 on (the same point of the same cosine).
    metrics = tmp_path / "overridden.jsonl"
    proc = run_pretrain([*RUN, *ITERS, "--lr", "2.5e-3", "--min-lr", "2.5e-4", "--override-opt_param-scheduler",
                         *load, "--metrics-file", str(metrics)], timeout=300)
    assert "--override-opt_param-scheduler: this run's schedule replaces the checkpoint's" in proc.stderr
    overridden = _records(metrics)
    assert all(overridden[i][0] == pytest.approx(10 * reference[i][0], rel=1e-9) for i in (3, 4)), overridden

    # Saved before the record: loads, unchecked.
    del meta["schedule"]
    (ckpt / "checkpoint.json").write_text(json.dumps(meta))
    (ckpt / "manifest.json").unlink()  # hand-edited: loaded unverified, as a checkpoint without a manifest
    proc = run_pretrain([*RUN, *ITERS, "--lr", "2.5e-3", *load], timeout=300)
    assert "records no learning-rate schedule (saved before the record): not checked" in proc.stderr


@pytest.mark.timeout(300)
def test_a_resume_without_the_checkpoints_batch_ramp_is_refused(tmp_path):
    samples = ["--train-samples", "48", "--lr-decay-samples", "48", "--lr-warmup-iters", "0",
               "--lr-warmup-samples", "8"]
    save = tmp_path / "ramp"
    run_pretrain([*RUN, *samples, "--rampup-batch-size", "4", "4", "16", "--save", str(save), "--save-interval", "2"],
                 timeout=300)
    _refused([*RUN, *samples, "--load", str(save / "iter_0000002")],
             "[consumed samples, global batch] at each change; --rampup-batch-size, --step-batch-size-schedule): "
             "checkpoint [[0, 4], [16, 8]] vs run [[0, 8]]")


@pytest.mark.timeout(300)
def test_a_constant_rate_extended_past_its_train_iters_continues(tmp_path):
    """No rate of a constant schedule depends on its decay length, so a longer --train-iters is let through."""
    constant = [*RUN, "--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
    save = tmp_path / "constant"
    run_pretrain([*constant, "--train-iters", "2", "--save", str(save)], timeout=300)
    metrics = tmp_path / "extended.jsonl"
    run_pretrain([*constant, "--train-iters", "4", "--load", str(save), "--metrics-file", str(metrics)], timeout=300)
    assert sorted(_records(metrics)) == [3, 4]
