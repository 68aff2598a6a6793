"""The global batch of every iteration: constant, Megatron's ramp-up, or Megatron's step schedule.

Megatron-LM looks the batch of each iteration up at the samples consumed before it (``update_num_microbatches(
args.consumed_train_samples)`` at the top of every iteration of ``train()``), runs ``batch // (micro x DP)``
micro-batches, adds the batch to the consumed samples and steps its learning-rate scheduler by the same number
(``opt_param_scheduler.step(increment=num_microbatches x micro x DP)``), so the rate follows consumed samples.
Sources, NVIDIA/Megatron-LM ``megatron/core/num_microbatches_calculator.py`` and ``megatron/training/training.py``:

- ``--rampup-batch-size START INCR SAMPLES``: ``RampupBatchsizeNumMicroBatchesCalculator`` and
  ``update_train_iters`` at commit 157006d6 (2026-02, the last version before PR #4411). The batch grows from
  START by INCR, one step every SAMPLES / ((global - START) / INCR) consumed samples (a float, Megatron's
  ``rampup_samples_per_increment``), and is ``--global-batch-size`` once more than SAMPLES are consumed. PR #4411
  (commit 532ad926) made the flag a deprecated no-op (``init_num_microbatches_calculator`` only warns); it changes
  the maths, so domino runs it as 157006d6 did instead of ignoring it.
- ``--step-batch-size-schedule "THRESHOLD:BS ..."``: ``StepBatchsizeNumMicroBatchesCalculator`` of PR #4411 (commit
  532ad926, unchanged at d98e8a64). Thresholds are tokens (Megatron's training always passes ``seq_length``, in
  ``global_vars.set_global_variables``), turned into samples by ``// seq_length``; K/M/B/T suffixes; the batch of
  the last threshold at or below the consumed samples applies.

The float arithmetic is Megatron's, so a run resumed from Megatron's consumed-sample count steps up at the same
iteration. Every batch a run reaches must divide into micro-batches of ``--micro-batch-size`` x DP; Megatron
checks the current one at each iteration, domino all of them before the run starts.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

from domino.config.errors import ConfigError
from domino.config.layout import ramps_batch_size, virtual_stages
from domino.config.pipeline_schedule import microbatch_problems
from domino.config.schema import DominoConfig

RAMPUP_FLAG = "--rampup-batch-size"
STEP_FLAG = "--step-batch-size-schedule"
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class BatchSizeSchedule(ABC):
    """The global batch as a function of consumed samples; subclasses say how it grows."""

    global_batch_size: int
    """The batch the schedule ends at (the checkpoint's and the evaluation's global batch)."""
    micro_batch_size: int
    """``--micro-batch-size``."""
    data_parallel_size: int
    """Data-parallel replicas."""

    @abstractmethod
    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` samples."""

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches per data-parallel rank once the schedule has reached :attr:`global_batch_size`."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def num_micro_batches_at(self, consumed_samples: int) -> int:
        """Micro-batches each data-parallel rank runs in that iteration."""
        return self.global_batch_size_at(consumed_samples) // (self.micro_batch_size * self.data_parallel_size)

    @abstractmethod
    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run (Megatron's ``update_train_iters``)."""

    def iterations(self, train_samples: int) -> Iterator[Tuple[int, int]]:
        """``(consumed samples before, global batch)`` of every iteration of a ``train_samples`` run, in order."""
        consumed = 0
        for _ in range(self.train_iters(train_samples)):
            batch = self.global_batch_size_at(consumed)
            yield consumed, batch
            consumed += batch

    def consumed_samples_after(self, iteration: int) -> int:
        """Samples consumed when ``iteration`` iterations are done."""
        consumed = 0
        for _ in range(iteration):
            consumed += self.global_batch_size_at(consumed)
        return consumed

    def _check_divisible(self, flag: str, batches: Sequence[int]) -> None:
        per_step = self.micro_batch_size * self.data_parallel_size
        for batch in batches:
            if batch % per_step:
                raise ConfigError(f"{flag}: the global batch {batch} is not divisible by --micro-batch-size "
                                  f"{self.micro_batch_size} x {self.data_parallel_size} data-parallel replicas")


@dataclass(frozen=True)
class ConstantBatchSize(BatchSizeSchedule):
    """``--global-batch-size`` at every iteration."""

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int

    def global_batch_size_at(self, consumed_samples: int) -> int:
        return self.global_batch_size

    def train_iters(self, train_samples: int) -> int:
        # domino trains a partial last batch in full (Megatron drops it: train_samples // global batch).
        return math.ceil(train_samples / self.global_batch_size)

    def consumed_samples_after(self, iteration: int) -> int:
        return iteration * self.global_batch_size


@dataclass(frozen=True)
class BatchSizeRampup(BatchSizeSchedule):
    """``--rampup-batch-size START INCR SAMPLES``: see :meth:`from_flag`."""

    start: int
    """Global batch size of the first iteration."""
    increment: int
    """Global batch size added at each step-up."""
    samples: int
    """Consumed samples over which the batch grows to :attr:`global_batch_size`."""
    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int

    @classmethod
    def from_flag(cls, values: Sequence[int], global_batch_size: int, micro_batch_size: int,
                  data_parallel_size: int) -> "BatchSizeRampup":
        """Checks Megatron's rules on ``--rampup-batch-size`` and returns the ramp.

        Raises:
            ConfigError: One line naming the flag and the rule broken (where Megatron would divide by zero, too).
        """
        if len(values) != 3:
            raise ConfigError(f"{RAMPUP_FLAG} takes START INCR SAMPLES, got {len(values)} values")
        start, increment, samples = (int(v) for v in values)
        rule = None
        if start <= 0 or increment <= 0:
            rule = f"START ({start}) and INCR ({increment}) must be > 0"
        elif samples <= 0:
            rule = f"SAMPLES must be > 0, got {samples}"
        elif global_batch_size <= start:
            rule = f"START {start} must be smaller than --global-batch-size {global_batch_size}"
        elif (global_batch_size - start) % increment:
            rule = f"--global-batch-size {global_batch_size} - START {start} is not divisible by INCR {increment}"
        if rule:
            raise ConfigError(f"{RAMPUP_FLAG} {start} {increment} {samples}: {rule}")
        ramp = cls(start, increment, samples, global_batch_size, micro_batch_size, data_parallel_size)
        reached = sorted({batch for _, batch in ramp.iterations(samples + 1)})
        ramp._check_divisible(f"{RAMPUP_FLAG} {start} {increment} {samples}", reached)
        return ramp

    @property
    def samples_per_increment(self) -> float:
        """Consumed samples between step-ups (Megatron's ``rampup_samples_per_increment``)."""
        return self.samples / ((self.global_batch_size - self.start) // self.increment)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        if consumed_samples > self.samples:
            return self.global_batch_size
        return self.start + int(consumed_samples / self.samples_per_increment) * self.increment

    def train_iters(self, train_samples: int) -> int:
        iterations, consumed = 0, 0
        # Megatron counts the ramp's iterations while consumed <= SAMPLES, the one that crosses included, then
        # whole global batches (a partial last one is dropped).
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


@dataclass(frozen=True)
class StepBatchSizeSchedule(BatchSizeSchedule):
    """``--step-batch-size-schedule``: see :meth:`from_flag`."""

    steps: Tuple[Tuple[int, int], ...]
    """``(threshold in samples, global batch)`` pairs, thresholds strictly increasing from 0."""
    micro_batch_size: int
    data_parallel_size: int

    @classmethod
    def from_flag(cls, text: str, seq_length: int, micro_batch_size: int,
                  data_parallel_size: int) -> "StepBatchSizeSchedule":
        """Parses ``"THRESHOLD:BS THRESHOLD:BS ..."`` (token thresholds; commas also separate) as Megatron does.

        Raises:
            ConfigError: One line naming the flag and the entry or rule at fault.
        """
        steps: List[Tuple[int, int]] = []
        for entry in text.strip().replace(",", " ").split():
            threshold, colon, batch = entry.partition(":")
            if not colon:
                raise ConfigError(f'{STEP_FLAG}: entry "{entry}" is not THRESHOLD:BATCH_SIZE')
            steps.append((_count(threshold, entry) // seq_length, _count(batch, entry)))
        steps.sort(key=lambda step: step[0])
        rule = None
        if not steps:
            rule = "no THRESHOLD:BATCH_SIZE entries"
        elif steps[0][0] != 0:
            rule = f"the first threshold must be 0, got {steps[0][0]} samples (tokens // --seq-length {seq_length})"
        elif any(b[0] <= a[0] for a, b in zip(steps, steps[1:])):
            rule = f"thresholds must be distinct after the division by --seq-length {seq_length} (in samples: " \
                   f"{', '.join(str(s[0]) for s in steps)})"
        elif any(batch <= 0 for _, batch in steps):
            rule = "batch sizes must be > 0"
        elif any(b[1] < a[1] for a, b in zip(steps, steps[1:])):
            # Megatron's train() asserts that the number of micro-batches never decreases (532ad926).
            rule = "batch sizes must not decrease"
        if rule:
            raise ConfigError(f'{STEP_FLAG} "{text}": {rule}')
        return cls(tuple(steps), micro_batch_size, data_parallel_size)

    @property
    def global_batch_size(self) -> int:  # type: ignore[override]
        return self.steps[-1][1]

    def global_batch_size_at(self, consumed_samples: int) -> int:
        batch = self.steps[0][1]
        for threshold, size in self.steps:
            if consumed_samples < threshold:
                break
            batch = size
        return batch

    def _segments(self) -> Iterator[Tuple[int, Optional[int], int]]:
        """``(start, end or None, batch)`` of each step, in samples."""
        ends = [threshold for threshold, _ in self.steps[1:]] + [None]
        for (threshold, batch), end in zip(self.steps, ends):
            yield threshold, end, batch

    def train_iters(self, train_samples: int) -> int:
        # Megatron 532ad926: iterations while consumed < train_samples (a partial last batch is trained in full),
        # counted here step by step of the schedule instead of iteration by iteration.
        iterations, consumed = 0, 0
        for _, end, batch in self._segments():
            stop = train_samples if end is None else min(end, train_samples)
            if consumed < stop:
                n = -(-(stop - consumed) // batch)
                iterations, consumed = iterations + n, consumed + n * batch
        return iterations

    def consumed_samples_after(self, iteration: int) -> int:
        consumed = 0
        for _, end, batch in self._segments():
            if end is None:
                n = iteration
            else:  # a batch may overshoot a whole step: then no iteration runs at its size
                n = min(iteration, max(0, -(-(end - consumed) // batch)))
            iteration, consumed = iteration - n, consumed + n * batch
        return consumed

    def check_reached(self, train_samples: int) -> None:
        """Raises :class:`ConfigError` if a batch that a ``train_samples`` run reaches does not divide."""
        self._check_divisible(STEP_FLAG, [batch for threshold, batch in self.steps if threshold < train_samples])


def _count(text: str, entry: str) -> int:
    """Megatron's ``_parse_numeric_value``: a number with an optional K/M/B/T suffix, truncated to an int."""
    value = text.strip().upper()
    multiplier = _SUFFIXES.get(value[-1:], 1)
    if value[-1:] in _SUFFIXES:
        value = value[:-1]
    try:
        return int(float(value) * multiplier)
    except ValueError:
        raise ConfigError(f'{STEP_FLAG}: "{text}" in entry "{entry}" is not a number (K/M/B/T suffixes '
                          "allowed)") from None


def check_batch_flags(config: DominoConfig) -> List[str]:
    """The combinations Megatron refuses (and one it leaves ill-defined), as one-line messages."""
    t = config.train
    problems = []
    if t.rampup_batch_size is not None and t.step_batch_size_schedule is not None:
        problems.append(f"{RAMPUP_FLAG} and {STEP_FLAG} are mutually exclusive (Megatron's step schedule "
                        "replaced the ramp)")
    if t.rampup_batch_size is not None and t.train_iters is not None:
        # megatron/training/arguments.py at 157006d6, validate_args: "expected no batch-size rampup for
        # iteration-based training".
        problems.append(f"{RAMPUP_FLAG} needs --train-samples, not --train-iters (Megatron refuses ramp-up for "
                        "iteration-based training: the learning-rate schedule counts samples)")
    if t.step_batch_size_schedule is not None:
        if t.global_batch_size is not None:
            # megatron/training/arguments.py since 532ad926, validate_args.
            problems.append(f"{STEP_FLAG} and --global-batch-size are mutually exclusive (the schedule's last "
                            "batch is the global batch, as in Megatron)")
        if t.train_iters is not None:
            # Megatron accepts it but then measures --lr-*-iters in batches of --micro-batch-size x DP (its
            # default --global-batch-size) while its scheduler advances by the growing batch.
            problems.append(f"{STEP_FLAG} needs --train-samples, not --train-iters (the learning-rate schedule "
                            "counts samples; iterations of a growing batch have no fixed length)")
        if config.model.seq_length >= 1:
            try:  # the syntax; the batches are checked against the layout by batch_schedule_problems
                StepBatchSizeSchedule.from_flag(t.step_batch_size_schedule, config.model.seq_length, 1, 1)
            except ConfigError as error:
                problems.append(str(error))
    return problems


def batch_schedule_problems(config: DominoConfig, data_parallel_size: int) -> List[str]:
    """:func:`batch_schedule`'s refusal as a list of messages (empty when the schedule fits the layout)."""
    try:
        schedule = batch_schedule(config, data_parallel_size)
    except ConfigError as error:
        return [str(error)]
    if not ramps_batch_size(config):  # a fixed batch: layout.pipeline_problems checks it, naming the flag
        return []
    pp, first = config.parallel.pipeline_model_parallel_size, schedule.num_micro_batches_at(0)
    if pp > 1 and first < pp:
        return [f"the first global batch {schedule.global_batch_size_at(0)} gives {first} micro-batches of "
                f"--micro-batch-size {schedule.micro_batch_size} per data-parallel rank (DP {data_parallel_size}), "
                f"fewer than --pipeline-model-parallel-size {pp} (the 1F1B schedule needs one per stage)"]
    v = virtual_stages(config)
    if pp > 1 and v > 1:  # the interleaved schedule's rule holds for every batch the schedule reaches
        per_step = schedule.micro_batch_size * data_parallel_size
        for batch in reached_global_batches(schedule):
            problems = microbatch_problems(batch // per_step, pp, v)
            if problems:
                return [f"the global batch {batch} the batch-size schedule reaches: {problems[0]}"]
    return []


def reached_global_batches(schedule: BatchSizeSchedule) -> List[int]:
    """Every global batch ``schedule`` can run, smallest first (a ramp's steps, the step schedule's batches)."""
    if isinstance(schedule, BatchSizeRampup):
        return sorted({*range(schedule.start, schedule.global_batch_size, schedule.increment),
                       schedule.global_batch_size})
    if isinstance(schedule, StepBatchSizeSchedule):
        return sorted({batch for _, batch in schedule.steps})
    return [schedule.global_batch_size]


def batch_schedule(config: DominoConfig, data_parallel_size: int) -> BatchSizeSchedule:
    """The run's schedule at ``data_parallel_size`` replicas, every batch it reaches checked to divide.

    Raises:
        ConfigError: One line naming the flag at fault.
    """
    t = config.train
    if t.rampup_batch_size is not None:
        gbs = t.global_batch_size or t.micro_batch_size * data_parallel_size
        return BatchSizeRampup.from_flag(t.rampup_batch_size, gbs, t.micro_batch_size, data_parallel_size)
    if t.step_batch_size_schedule is not None:
        schedule = StepBatchSizeSchedule.from_flag(t.step_batch_size_schedule, config.model.seq_length,
                                                   t.micro_batch_size, data_parallel_size)
        schedule.check_reached(t.train_samples if t.train_samples is not None else math.inf)
        return schedule
    return ConstantBatchSize(t.global_batch_size or t.micro_batch_size * data_parallel_size, t.micro_batch_size,
                             data_parallel_size)
