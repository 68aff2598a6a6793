"""Megatron's batch-size ramp-up in training: the batch of each iteration, the learning rate in samples, the
checkpoint at each step-up, a resume across a step-up equal to the uninterrupted run bit for bit (fp32, no
dropout, one process), and the same run on two pipeline stages (two processes).

The rules are NVIDIA/Megatron-LM's ``train()`` / ``train_step`` (megatron/training/training.py at 157006d6): the
batch is looked up at the consumed samples before each iteration, the scheduler advances by that batch, and a
checkpoint is saved whenever the number of micro-batches changes. The calculators themselves are checked against
Megatron's in tests/config/test_batch_schedule.py.
"""

import math
import shutil

import pytest
from safetensors.torch import load_file

from train_helpers import read_metrics, run_pretrain

BASE = ["--preset", "tiny", "--log-interval", "1", "--num-workers", "0", "--seed", "7", "--mock-data",
        "--vocab-size", "256", "--eval-iters", "0", "--eval-interval", "0", "--micro-batch-size", "2",
        "--lr-warmup-iters", "0", "--lr-warmup-samples", "8", "--train-samples", "76"]
#: START 4, INCR 4 up to 16 over 24 samples: a step-up every 24 / 3 = 8 consumed samples.
RAMP = ["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "24"]
#: The same batches as Megatron's step schedule, thresholds in tokens (x --seq-length 64): 8, 16, 28 samples.
STEPS = ["--step-batch-size-schedule", "0:4 512:8 1024:12 1792:16"]
#: Megatron's calculator on RAMP: (consumed before, batch) of the 7 iterations of a 76-sample run.
EXPECTED = [(0, 4), (4, 4), (8, 8), (16, 12), (28, 16), (44, 16), (60, 16)]


def _megatron_lr(num_steps, max_lr=0.003, min_lr=0.0003, warmup=8, decay=76):
    """OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py), cosine, in samples."""
    if num_steps <= warmup:
        return max_lr * num_steps / warmup
    ratio = (num_steps - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def _records(path):
    keep = ("consumed_samples", "batch_size", "lm_loss", "grad_norm", "lr")
    return {r["iteration"]: tuple(r[k] for k in keep) for r in read_metrics(path) if "eval" not in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted one-process run: its checkpoints, records and log."""
    out = tmp_path_factory.mktemp("ramp-reference")
    proc = run_pretrain([*BASE, *RAMP, "--save", str(out / "save"), "--metrics-file", str(out / "metrics.jsonl")])
    return out / "save", _records(out / "metrics.jsonl"), proc.stderr


def test_ramp_runs_megatrons_batches_and_resumes_across_a_step_up_bit_for_bit(tmp_path, reference):
    ref_save, records, log = reference
    assert sorted(records) == list(range(1, 8))
    for iteration, (before, batch) in enumerate(EXPECTED, start=1):
        consumed, logged_batch, _, _, lr = records[iteration]
        assert (consumed, logged_batch) == (before + batch, batch)
        assert lr == _megatron_lr(before)  # the rate at the samples consumed, not at iteration x 16
    assert "iteration 3: global batch 8 -> 12 at 16 samples" in log
    # Megatron saves when the micro-batch count changes: after iterations 2, 3 and 4, then the final one.
    assert sorted(p.name for p in ref_save.glob("iter_*")) == [f"iter_000000{i}" for i in (2, 3, 4, 7)]

    # Stopped after the step-up 4 -> 8 (at iteration 3); the resumed run steps up to 12 and 16 itself, here
    # driven by the same batches written as a step schedule.
    save, metrics = tmp_path / "run", tmp_path / "run.jsonl"
    shutil.copytree(ref_save / "iter_0000003", save / "iter_0000003")
    (save / "latest").write_text("iter_0000003\n")
    resumed = run_pretrain([*BASE, *STEPS, "--save", str(save), "--load", str(save), "--metrics-file",
                            str(metrics)])
    assert "resumed from" in resumed.stderr
    after = _records(metrics)
    assert sorted(after) == [4, 5, 6, 7]
    assert after == {i: records[i] for i in (4, 5, 6, 7)}  # exact float equality
    ref_weights = load_file(ref_save / "iter_0000007" / "model" / "tp_rank_00.safetensors")
    run_weights = load_file(save / "iter_0000007" / "model" / "tp_rank_00.safetensors")
    assert sorted(ref_weights) == sorted(run_weights)
    assert all(ref_weights[name].equal(run_weights[name]) for name in ref_weights)


def test_two_pipeline_stages_run_the_ramp_as_one_stage(tmp_path, reference):
    """Under pipeline parallelism each step's micro-batch count (2, 4, 6, then 8 here) runs on its own 1F1B
    schedule; the losses and gradient norms are the one-stage run's within fp32 tolerance."""
    _, expected, _ = reference
    metrics = tmp_path / "pp2.jsonl"
    run_pretrain([*BASE, *RAMP, "--metrics-file", str(metrics), "--pipeline-model-parallel-size", "2"], nproc=2)
    records = _records(metrics)
    assert sorted(records) == sorted(expected)
    for iteration, (consumed, batch, loss, grad_norm, lr) in records.items():
        ref = expected[iteration]
        assert (consumed, batch, lr) == (ref[0], ref[1], ref[4])
        assert loss == pytest.approx(ref[2], rel=1e-5) and grad_norm == pytest.approx(ref[3], rel=1e-4), iteration
