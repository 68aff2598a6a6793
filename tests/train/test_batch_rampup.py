"""The batch-size ramp-up calculator against Megatron-LM's own code, transcribed below from NVIDIA/Megatron-LM
commit 157006d6: ``RampupBatchsizeNumMicroBatchesCalculator.update`` (megatron/core/num_microbatches_calculator.py)
and ``update_train_iters`` plus the loop's ``consumed_train_samples += batch_size`` (megatron/training/training.py)."""

import re

import pytest

from domino.config import ConfigError, parse_config
from domino.train.batch_rampup import BatchSizeRampup


class _MegatronRampup:
    """Megatron's calculator, line for line (asserts and logging left out)."""

    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size, start, incr, ramup_samples):
        self.global_batch_size, self.start_global_batch_size = global_batch_size, start
        self.batch_size_increment, self.ramup_samples = incr, ramup_samples
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        num_increments = (global_batch_size - start) // incr
        self.rampup_samples_per_increment = self.ramup_samples / num_increments
        self.update(0)

    def update(self, consumed_samples):
        if consumed_samples > self.ramup_samples:
            self.current_global_batch_size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = self.start_global_batch_size + steps * self.batch_size_increment
        self.num_micro_batches = self.current_global_batch_size // self.micro_batch_times_data_parallel_size


def _megatron_train_iters(calc, train_samples):
    iterations, consumed = 0, 0
    while consumed <= calc.ramup_samples and consumed <= train_samples:
        calc.update(consumed)
        consumed += calc.current_global_batch_size
        iterations += 1
    calc.update(0)
    if train_samples > consumed:
        iterations += (train_samples - consumed) // calc.global_batch_size
    return iterations


def _megatron_run(calc, train_samples):
    """(consumed before, global batch, micro-batches) of every iteration of Megatron's loop."""
    out, consumed = [], 0
    for _ in range(_megatron_train_iters(calc, train_samples)):
        calc.update(consumed)
        out.append((consumed, calc.current_global_batch_size, calc.num_micro_batches))
        consumed += calc.current_global_batch_size
    return out


@pytest.mark.parametrize("start, incr, samples, gbs, mbs, dp, train_samples", [
    (16, 16, 5859375 // 1000, 1536, 1, 16, 40000),  # the 175B script's ramp, shortened
    (4, 4, 100, 32, 2, 2, 1000),
    (8, 8, 99, 64, 4, 2, 450),  # SAMPLES not a multiple of the increments: fractional samples per step
    (2, 2, 7, 16, 1, 2, 5),  # the run ends inside the ramp
    (6, 3, 1000, 12, 3, 1, 2000),
])
def test_schedule_equals_megatrons(start, incr, samples, gbs, mbs, dp, train_samples):
    ramp = BatchSizeRampup.from_flag([start, incr, samples], gbs, mbs, dp)
    reference = _MegatronRampup(gbs, mbs, dp, start, incr, samples)
    assert ramp.train_iters(train_samples) == _megatron_train_iters(reference, train_samples)
    mine = [(c, b, ramp.num_micro_batches_at(c)) for c, b in ramp.iterations(train_samples)]
    assert mine == _megatron_run(reference, train_samples)
    assert [b for _, b, _ in mine] == sorted(b for _, b, _ in mine) and mine[0][1] == start
    for iteration in (0, 1, len(mine) // 2, len(mine)):
        assert ramp.consumed_samples_after(iteration) == sum(b for _, b, _ in mine[:iteration])
    for consumed in range(0, samples + 3 * gbs):
        reference.update(consumed)
        assert ramp.global_batch_size_at(consumed) == reference.current_global_batch_size


def test_the_175b_ramp_by_hand():
    """16 -> 1536 by 16: 95 step-ups, one every 5859375 / 95 = 61677.6 samples."""
    ramp = BatchSizeRampup.from_flag([16, 16, 5859375], 1536, 1, 16)
    assert ramp.global_batch_size_at(0) == 16 and ramp.global_batch_size_at(61677) == 16
    assert ramp.global_batch_size_at(61678) == 32 and ramp.global_batch_size_at(5859375) == 1536
    assert ramp.num_micro_batches_at(0) == 1 and ramp.num_micro_batches_at(10**7) == 96


@pytest.mark.parametrize("values, gbs, mbs, dp, message", [
    ([16, 16], 64, 1, 1, "--rampup-batch-size takes START INCR SAMPLES, got 2 values"),
    ([0, 16, 100], 64, 1, 1, "START (0) and INCR (16) must be > 0"),
    ([16, 16, 0], 64, 1, 1, "SAMPLES must be > 0, got 0"),
    ([64, 16, 100], 64, 1, 1, "START 64 must be smaller than --global-batch-size 64"),
    ([16, 20, 100], 64, 1, 1, "--global-batch-size 64 - START 16 is not divisible by INCR 20"),
    ([2, 2, 100], 8, 2, 2, "the ramp's global batch 2 is not divisible by --micro-batch-size 2 x 2 data-parallel"),
])
def test_megatrons_rules_are_one_line_errors(values, gbs, mbs, dp, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        BatchSizeRampup.from_flag(values, gbs, mbs, dp)


def test_the_flag_is_refused_until_training_runs_the_ramp():
    with pytest.raises(ConfigError, match=r"^--rampup-batch-size: batch-size ramp-up: not supported yet"):
        parse_config(["--rampup-batch-size", "16", "16", "5859375"])
    with pytest.raises(SystemExit):  # Megatron's values are integers
        parse_config(["--rampup-batch-size", "16", "x", "5"])
