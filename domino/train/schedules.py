"""Learning-rate schedule: Megatron-LM's ``OptimizerParamScheduler``, step for step.

The rate of the optimizer step that follows ``iteration`` completed iterations is Megatron's ``get_lr()`` at
``num_steps = iteration x global batch`` (Megatron counts its scheduler in samples and steps it by the global
batch after every iteration, so its first step runs at ``--lr-warmup-init``, 0 by default). Source:
``megatron/core/optimizer_param_scheduler.py`` and ``get_optimizer_param_scheduler`` in
``megatron/training/training.py``, NVIDIA/Megatron-LM core_r0.11.0 (commit 7c00175e6b24b3cd835d21a9d287c35a07e275b3).

The schedule is a pure function of the consumed samples (the iteration times the batch, unless the batch grows:
:mod:`domino.config.batch_schedule`), so resuming needs no schedule state: the checkpoint's consumed samples
determine the rate.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

from domino.config import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearningRateSchedule:
    """Warm-up then decay, in samples like Megatron; see :meth:`lr_at`."""

    max_lr: float
    """Peak learning rate reached at the end of warm-up."""
    min_lr: float
    """Floor reached at the end of decay and kept afterwards."""
    warmup_steps: float
    """Samples of linear warm-up from ``init_lr`` to ``max_lr`` (may be fractional, as Megatron's)."""
    decay_steps: int
    """Sample count at which decay ends (counted from 0, warm-up included)."""
    style: str
    """``constant``, ``linear``, ``cosine``, ``inverse-square-root`` or ``WSD``."""
    global_batch_size: int = 1
    """Samples per iteration: the scheduler advances by this much after every iteration."""
    init_lr: float = 0.0
    """Rate at the start of warm-up (``--lr-warmup-init``)."""
    wsd_decay_steps: Optional[int] = None
    """Samples of the WSD annealing phase, which ends at ``decay_steps``."""
    wsd_style: str = "exponential"
    """Shape of the WSD annealing phase: ``exponential``, ``linear`` or ``cosine``."""

    @classmethod
    def from_config(cls, train: TrainConfig, train_iters: int, global_batch_size: int = 1) -> "LearningRateSchedule":
        """Builds the schedule from the ``--lr*`` flags for ``train_iters`` iterations of ``global_batch_size``.

        Megatron's rules: with ``--train-iters`` the lengths are ``--lr-*-iters`` times the global batch, with
        ``--train-samples`` they are the ``--lr-*-samples`` values; ``--lr-warmup-fraction`` is a fraction of
        the decay length.
        """
        gbs = global_batch_size
        if train.train_samples is not None:
            decay = train.lr_decay_samples or train.train_samples
            warmup_given = train.lr_warmup_samples
            wsd = train.lr_wsd_decay_samples
        else:
            decay = (train.lr_decay_iters or train_iters) * gbs
            warmup_given = train.lr_warmup_iters * gbs
            wsd = train.lr_wsd_decay_iters * gbs if train.lr_wsd_decay_iters is not None else None
        warmup = train.lr_warmup_fraction * decay if train.lr_warmup_fraction is not None else warmup_given
        if warmup > decay:
            # Megatron asserts here; a preset's warm-up can outlast a short smoke run, so warm up over the whole
            # decay length instead.
            logger.warning("warm-up of %g samples is longer than the %d decay samples: shortened to %d",
                           warmup, decay, decay)
            warmup = decay
        return cls(train.lr, train.min_lr, warmup, decay, train.lr_decay_style, gbs, train.lr_warmup_init, wsd,
                   train.lr_wsd_decay_style)

    @property
    def warmup_iters(self) -> float:
        """Warm-up length in iterations."""
        return self.warmup_steps / self.global_batch_size

    @property
    def decay_iters(self) -> float:
        """Decay length in iterations."""
        return self.decay_steps / self.global_batch_size

    def lr_at(self, iteration: int) -> float:
        """Learning rate of the optimizer step taken after ``iteration`` completed iterations of a constant batch."""
        return self.lr_at_samples(iteration * self.global_batch_size)

    def lr_at_samples(self, num_steps: int) -> float:
        """Learning rate of the optimizer step taken after ``num_steps`` consumed samples (what Megatron's
        scheduler has counted then; with a growing batch the iteration alone does not say it)."""
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * num_steps / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if num_steps > self.decay_steps:
            return self.min_lr
        if self.style == "inverse-square-root":
            lr = self.max_lr * max(self.warmup_steps, 1) ** 0.5 / max(num_steps, 1) ** 0.5
            return max(self.min_lr, lr)
        decay_ratio = (num_steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD: hold max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if num_steps <= anneal_start:
                coeff = 1.0
            else:
                ratio = (num_steps - anneal_start) / self.wsd_decay_steps
                if self.wsd_style == "linear":
                    coeff = 1.0 - ratio
                elif self.wsd_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
                else:
                    coeff = 2.0 * math.pow(0.5, ratio) - 1.0
        return self.min_lr + coeff * (self.max_lr - self.min_lr)
