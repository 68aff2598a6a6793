"""The batch-size schedules against Megatron-LM's own code, transcribed below from NVIDIA/Megatron-LM:
``RampupBatchsizeNumMicroBatchesCalculator.update`` at commit 157006d6 and ``StepBatchsizeNumMicroBatchesCalculator``
at commit 532ad926 (PR #4411) in megatron/core/num_microbatches_calculator.py, and ``update_train_iters`` plus the
loop's ``consumed_train_samples += batch_size`` (megatron/training/training.py) at the same commits."""

import re

import pytest

from domino.config import ConfigError, parse_config, validate
from domino.config.batch_schedule import BatchSizeRampup, StepBatchSizeSchedule


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
    ([2, 2, 100], 8, 2, 2, "the global batch 2 is not divisible by --micro-batch-size 2 x 2 data-parallel"),
])
def test_megatrons_rules_are_one_line_errors(values, gbs, mbs, dp, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        BatchSizeRampup.from_flag(values, gbs, mbs, dp)


class _MegatronStepSchedule:
    """Megatron's StepBatchsizeNumMicroBatchesCalculator (532ad926), line for line (asserts and logging left out)."""

    def __init__(self, micro_batch_size, data_parallel_size, schedule, seq_length):
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.schedule = self._parse_schedule(schedule, seq_length)
        self.global_batch_size = self.schedule[-1][1]
        self.update(0)

    @staticmethod
    def _parse_numeric_value(value_str):
        value_str = value_str.strip().upper()
        multiplier = 1
        if value_str.endswith('T'):
            multiplier, value_str = 1_000_000_000_000, value_str[:-1]
        elif value_str.endswith('B'):
            multiplier, value_str = 1_000_000_000, value_str[:-1]
        elif value_str.endswith('M'):
            multiplier, value_str = 1_000_000, value_str[:-1]
        elif value_str.endswith('K'):
            multiplier, value_str = 1_000, value_str[:-1]
        return int(float(value_str) * multiplier)

    @classmethod
    def _parse_schedule(cls, schedule_str, seq_length):
        schedule = []
        for entry in schedule_str.strip().replace(',', ' ').split():
            threshold_str, batch_size_str = entry.split(':', 1)
            threshold = cls._parse_numeric_value(threshold_str)
            batch_size = cls._parse_numeric_value(batch_size_str)
            if seq_length is not None:
                threshold = threshold // seq_length
            schedule.append((threshold, batch_size))
        schedule.sort(key=lambda x: x[0])
        return schedule

    def _get_batch_size_for_samples(self, consumed_samples):
        batch_size = self.schedule[0][1]
        for threshold, bs in self.schedule:
            if consumed_samples >= threshold:
                batch_size = bs
            else:
                break
        return batch_size

    def update(self, consumed_samples):
        self.current_global_batch_size = self._get_batch_size_for_samples(consumed_samples)
        self.num_micro_batches = self.current_global_batch_size // self.micro_batch_times_data_parallel_size


def _megatron_step_train_iters(calc, train_samples):
    """update_train_iters with a step schedule (532ad926)."""
    iterations, consumed = 0, 0
    while consumed < train_samples:
        calc.update(consumed)
        consumed += calc.current_global_batch_size
        iterations += 1
    calc.update(0)
    return iterations


@pytest.mark.parametrize("text, seq_length, mbs, dp, train_samples", [
    ("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048, 1, 16, 12 * 10**9 // 2048 + 5000),  # the 175B's
    ("0:4 640:8 1280:16", 64, 2, 2, 90),  # token thresholds: 10 and 20 samples
    ("0:4,100:12 200:16 210:20", 10, 4, 1, 77),  # commas, batches that overshoot a step
    ("1.5K:6 0:2", 1, 2, 1, 1600),  # unsorted, a fractional threshold with a suffix
    ("0:8 24:16", 1, 4, 2, 7),  # the run ends inside the first step
])
def test_step_schedule_equals_megatrons(text, seq_length, mbs, dp, train_samples):
    mine = StepBatchSizeSchedule.from_flag(text, seq_length, mbs, dp)
    reference = _MegatronStepSchedule(mbs, dp, text, seq_length)
    assert mine.global_batch_size == reference.global_batch_size
    iterations = mine.train_iters(train_samples)
    assert iterations == _megatron_step_train_iters(reference, train_samples)
    consumed = 0
    for iteration in range(iterations):
        reference.update(consumed)
        assert mine.consumed_samples_after(iteration) == consumed
        assert (mine.global_batch_size_at(consumed), mine.num_micro_batches_at(consumed)) == (
            reference.current_global_batch_size, reference.num_micro_batches)
        consumed += reference.current_global_batch_size
        if iterations > 2000 and iteration == 2000:
            break  # the 175B schedule: its first steps, then the totals only
    if iterations <= 2000:
        assert mine.consumed_samples_after(iterations) == consumed >= train_samples


@pytest.mark.parametrize("text, message", [
    ("0:16 2.4B", 'entry "2.4B" is not THRESHOLD:BATCH_SIZE'),
    ("0:16 2.4X:32", '"2.4X" in entry "2.4X:32" is not a number'),
    ("100:16 200:32", "the first threshold must be 0, got 1 samples (tokens // --seq-length 64)"),
    ("0:16 10:32 12:64", "thresholds must be distinct after the division by --seq-length 64"),
    ("0:16 640:0", "batch sizes must be > 0"),
    ("0:16 640:32 1280:16", "batch sizes must not decrease"),
    ("", "no THRESHOLD:BATCH_SIZE entries"),
])
def test_step_schedule_errors_are_one_line(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        StepBatchSizeSchedule.from_flag(text, 64, 1, 1)
    assert str(error.value).startswith("--step-batch-size-schedule") and "\n" not in str(error.value)


@pytest.mark.parametrize("argv, message", [
    (["--rampup-batch-size", "16", "16", "5859375", "--train-iters", "10"],
     "--rampup-batch-size needs --train-samples, not --train-iters (Megatron refuses ramp-up for iteration-based"),
    (["--step-batch-size-schedule", "0:4 64:8", "--global-batch-size", "8", "--train-samples", "10"],
     "--step-batch-size-schedule and --global-batch-size are mutually exclusive"),
    (["--step-batch-size-schedule", "0:4 64:8", "--train-iters", "10"],
     "--step-batch-size-schedule needs --train-samples, not --train-iters"),
    (["--step-batch-size-schedule", "0:4", "--rampup-batch-size", "4", "4", "8", "--global-batch-size", "8",
      "--train-samples", "10"], "--rampup-batch-size and --step-batch-size-schedule are mutually exclusive"),
    (["--step-batch-size-schedule", "0:4 64:6", "--train-samples", "100", "--micro-batch-size", "2"],
     "--step-batch-size-schedule: the global batch 6 is not divisible by --micro-batch-size 2 x 2 data-parallel"),
    (["--rampup-batch-size", "4", "2", "8", "--global-batch-size", "8", "--train-samples", "100",
      "--micro-batch-size", "2"], "--rampup-batch-size 4 2 8: the global batch 6 is not divisible by"),
    (["--rampup-batch-size", "4", "4", "8", "--global-batch-size", "16", "--train-samples", "10",
      "--pipeline-model-parallel-size", "2", "--micro-batch-size", "4"],
     "the first global batch 4 gives 1 micro-batches of --micro-batch-size 4 per data-parallel rank (DP 1), fewer "
     "than --pipeline-model-parallel-size 2 (the 1F1B schedule needs one per stage)"),
])
def test_megatrons_flag_rules_are_checked_before_work(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        validate(parse_config(["--preset", "tiny", "--lr-warmup-iters", "0", "--mock-data", *argv]), world_size=2,
                 for_training=True)
    assert "\n" not in str(error.value)


def test_a_schedule_entry_past_the_run_need_not_divide():
    """Only the batches a run reaches must divide into micro-batches (Megatron checks each at its iteration)."""
    config = parse_config(["--preset", "tiny", "--lr-warmup-iters", "0", "--mock-data", "--micro-batch-size", "2",
                           "--step-batch-size-schedule", "0:4 6400:6", "--train-samples", "100"])
    validate(config, world_size=2, for_training=True)  # 6400 tokens = 100 samples: never reached


def test_the_ramp_flags_parse_as_megatrons():
    with pytest.raises(SystemExit):  # Megatron's values are integers
        parse_config(["--rampup-batch-size", "16", "x", "5"])
    config = parse_config(["--rampup-batch-size", "16", "16", "5859375", "--train-samples", "10"])
    assert config.train.rampup_batch_size == [16, 16, 5859375]


@pytest.mark.parametrize("flags, said, rule", [
    (["--micro-batch-size", "4", "--global-batch-size", "4"], "--global-batch-size 4 gives 1 micro-batches",
     "gives 1 micro-batches"),
    (["--micro-batch-size", "1", "--global-batch-size", "3", "--num-layers", "4",
      "--num-layers-per-virtual-pipeline-stage", "1"],
     "--global-batch-size 3: the interleaved schedule needs the micro-batches per step",
     "the interleaved schedule needs"),
], ids=["1f1b", "interleaved"])
def test_a_fixed_global_batch_that_does_not_fit_the_stages_is_said_once(flags, said, rule):
    """Without a ramp the global batch is the only batch: one problem names --global-batch-size, not a second one
    from the batch schedule's own check of the same batch."""
    with pytest.raises(ConfigError) as error:
        validate(parse_config(["--preset", "tiny", "--lr-warmup-iters", "0", "--mock-data",
                               "--pipeline-model-parallel-size", "2", *flags]),
                 world_size=2, for_training=True)
    assert str(error.value).count(rule) == 1, str(error.value)
    assert said in str(error.value)
