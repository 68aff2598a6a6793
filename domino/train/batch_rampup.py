"""Megatron-LM's batch-size ramp-up (``--rampup-batch-size START INCR SAMPLES``) as a pure calculator.

The rules, read from NVIDIA/Megatron-LM at commit 157006d6 (2026-02, the last version with the flag before #4411
replaced it by step schedules): ``RampupBatchsizeNumMicroBatchesCalculator`` in
``megatron/core/num_microbatches_calculator.py`` and ``update_train_iters`` / the training loop in
``megatron/training/training.py``.

- The global batch grows from START by INCR, one step every SAMPLES / ((global - START) / INCR) consumed samples
  (a float, as Megatron's ``rampup_samples_per_increment``), and is the full ``--global-batch-size`` once more than
  SAMPLES samples are consumed. Each iteration's batch is looked up at the samples consumed before it.
- Micro-batches per iteration: that batch // (``--micro-batch-size`` x DP); every batch reached must divide evenly.
- Consumed samples advance by the batch of each iteration; the learning-rate scheduler is stepped by the same
  amount (``opt_param_scheduler.step(increment=num_microbatches x micro x DP)``), so the rate follows consumed
  samples, not iterations. That is why Megatron allows the ramp only with ``--train-samples``.
- ``--train-samples`` becomes iterations by walking the ramp, then whole global batches (a partial last one is
  dropped).

The float arithmetic is kept exactly as Megatron's so that a run resumed from Megatron's consumed-sample count
steps up at the same iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence, Tuple

from domino.config import ConfigError

FLAG = "--rampup-batch-size"


@dataclass(frozen=True)
class BatchSizeRampup:
    """A validated ramp: see :meth:`from_flag`."""

    start: int
    """Global batch size of the first iteration."""
    increment: int
    """Global batch size added at each step-up."""
    samples: int
    """Consumed samples over which the batch grows to :attr:`global_batch_size`."""
    global_batch_size: int
    """The batch after the ramp (``--global-batch-size``)."""
    micro_batch_size: int
    """``--micro-batch-size``."""
    data_parallel_size: int
    """Data-parallel replicas."""

    @classmethod
    def from_flag(cls, values: Sequence[int], global_batch_size: int, micro_batch_size: int,
                  data_parallel_size: int) -> "BatchSizeRampup":
        """Checks Megatron's rules on ``--rampup-batch-size`` and returns the ramp.

        Raises:
            ConfigError: One line naming the flag and the rule broken (where Megatron would divide by zero, too).
        """
        if len(values) != 3:
            raise ConfigError(f"{FLAG} takes START INCR SAMPLES, got {len(values)} values")
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
            raise ConfigError(f"{FLAG} {start} {increment} {samples}: {rule}")
        ramp = cls(start, increment, samples, global_batch_size, micro_batch_size, data_parallel_size)
        per_step = micro_batch_size * data_parallel_size
        for _, batch in ramp.iterations(samples + 1):
            if batch % per_step:
                raise ConfigError(f"{FLAG} {start} {increment} {samples}: the ramp's global batch {batch} is not "
                                  f"divisible by --micro-batch-size {micro_batch_size} x {data_parallel_size} "
                                  "data-parallel replicas")
        return ramp

    @property
    def samples_per_increment(self) -> float:
        """Consumed samples between step-ups (Megatron's ``rampup_samples_per_increment``)."""
        return self.samples / ((self.global_batch_size - self.start) // self.increment)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` samples."""
        if consumed_samples > self.samples:
            return self.global_batch_size
        return self.start + int(consumed_samples / self.samples_per_increment) * self.increment

    def num_micro_batches_at(self, consumed_samples: int) -> int:
        """Micro-batches each data-parallel rank runs in that iteration."""
        return self.global_batch_size_at(consumed_samples) // (self.micro_batch_size * self.data_parallel_size)

    def iterations(self, train_samples: int) -> Iterator[Tuple[int, int]]:
        """``(consumed samples before, global batch)`` of every iteration of a ``train_samples`` run, in order."""
        consumed = 0
        for _ in range(self.train_iters(train_samples)):
            batch = self.global_batch_size_at(consumed)
            yield consumed, batch
            consumed += batch

    def consumed_samples_after(self, iteration: int) -> int:
        """Samples consumed when ``iteration`` iterations are done (what a checkpoint at that iteration holds and
        what the learning-rate schedule is evaluated at)."""
        consumed = 0
        for _ in range(iteration):
            consumed += self.global_batch_size_at(consumed)
        return consumed

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run: Megatron's ``update_train_iters`` with the ramp."""
        iterations, consumed = 0, 0
        # Megatron counts the ramp's iterations while consumed <= SAMPLES, the one that crosses included.
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations
