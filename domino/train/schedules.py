"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay to ``--min-lr``.

The schedule is a pure function of the iteration (as in Megatron-LM's ``OptimizerParamScheduler`` when
counted in iterations), so resuming needs no schedule state: the checkpoint's iteration determines the rate.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from domino.config import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearningRateSchedule:
    """Warm-up then decay; see :meth:`lr_at`."""

    max_lr: float
    """Peak learning rate reached at the end of warm-up."""
    min_lr: float
    """Floor reached at the end of decay and kept afterwards."""
    warmup_iters: int
    """Iterations of linear warm-up from 0 to ``max_lr``."""
    decay_iters: int
    """Iteration at which decay ends (counted from 0, warm-up included)."""
    style: str
    """``constant``, ``linear`` or ``cosine``."""

    @classmethod
    def from_config(cls, train: TrainConfig, train_iters: int) -> "LearningRateSchedule":
        """Builds the schedule from the ``--lr*`` flags for a run of ``train_iters`` iterations."""
        decay_iters = train.lr_decay_iters or train_iters
        if train.lr_warmup_fraction is not None:
            warmup = int(train.lr_warmup_fraction * decay_iters)
        else:
            warmup = train.lr_warmup_iters
        if warmup > decay_iters:
            # A preset's warm-up can outlast a short smoke run; warm up over the whole run instead.
            logger.warning("warm-up of %d iterations is longer than the %d decay iterations: shortened to %d",
                           warmup, decay_iters, decay_iters)
            warmup = decay_iters
        return cls(train.lr, train.min_lr, warmup, decay_iters, train.lr_decay_style)

    def lr_at(self, iteration: int) -> float:
        """Learning rate for the optimizer step that produces iteration ``iteration + 1``.

        Warm-up is linear from ``max_lr / warmup_iters`` at step 0 up to ``max_lr``; Megatron uses the same
        ``(step + 1) / warmup`` shape so the first step never runs at exactly zero.
        """
        if self.warmup_iters > 0 and iteration < self.warmup_iters:
            return self.max_lr * (iteration + 1) / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if iteration >= self.decay_iters:
            return self.min_lr
        span = max(self.decay_iters - self.warmup_iters, 1)
        progress = (iteration - self.warmup_iters) / span
        if self.style == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (math.cos(math.pi * progress) + 1.0)
        return self.min_lr + (self.max_lr - self.min_lr) * factor
