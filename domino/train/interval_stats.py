"""The training numbers of one logging interval, accumulated on the device and read once per interval.

Reading a loss with ``float(loss)`` every iteration makes the host wait for the GPU to finish the step before
it may queue the next one; over an interval of ``--log-interval`` iterations the numbers below are instead
updated with device ops only, and :meth:`IntervalStats.read` copies them all to the host in one transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class IntervalReading:
    """What :meth:`IntervalStats.read` returns (host numbers)."""

    mean_loss: float
    """Mean of the interval's finite iteration losses (NaN when none was finite)."""
    non_finite: int
    """Iterations of the interval whose loss was NaN/inf."""
    nan_streak: int
    """Consecutive non-finite iterations ending at the last one (carried over intervals)."""
    streak_limit_at: Optional[int]
    """The iteration at which the streak first reached ``--max-nan-steps``, if it has."""
    last_finite_loss: Optional[float]
    """The loss of the last iteration with a finite loss, if any."""
    optimizer_skips: int
    """Updates skipped by domino's own overflow flag since the run started (see ``domino.optim.clipping.flag_overflow``)."""


class IntervalStats:
    """Per-interval sums on ``device``, updated without host reads.

    Args:
        device: where the losses live (the model's device).
        max_nan_steps: the ``--max-nan-steps`` limit whose crossing is recorded.
    """

    def __init__(self, device: torch.device, max_nan_steps: int) -> None:
        self.max_nan_steps = max_nan_steps

        def zero(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((), dtype=dtype, device=device)

        self.loss_sum, self.finite = zero(torch.float64), zero(torch.long)
        self.non_finite, self.nan_streak, self.streak_limit_at = zero(torch.long), zero(torch.long), zero(torch.long)
        self.last_finite_loss = torch.full((), math.nan, dtype=torch.float64, device=device)
        self.optimizer_skips = zero(torch.long)

    def add(self, loss: torch.Tensor, iteration: int) -> None:
        """Adds iteration ``iteration``'s loss (a 0-d device tensor, the data-parallel average)."""
        loss = loss.detach().to(torch.float64)
        finite = torch.isfinite(loss)
        self.loss_sum += torch.where(finite, loss, 0.0)
        self.finite += finite
        self.non_finite += ~finite
        self.nan_streak = torch.where(finite, 0, self.nan_streak + 1)
        reached = (self.nan_streak >= self.max_nan_steps) & (self.streak_limit_at == 0)
        self.streak_limit_at = torch.where(reached, iteration, self.streak_limit_at)
        self.last_finite_loss = torch.where(finite, loss, self.last_finite_loss)

    def add_optimizer_skip(self, skipped: torch.Tensor) -> None:
        """Counts an update skipped by ``skipped`` (a 0-d 0/1 device tensor)."""
        self.optimizer_skips += skipped.to(torch.long)

    def read(self) -> IntervalReading:
        """Copies everything to the host at once (the interval's only device sync) and starts a new interval."""
        values = torch.stack([self.loss_sum, self.finite.double(), self.non_finite.double(),
                              self.nan_streak.double(), self.streak_limit_at.double(), self.last_finite_loss,
                              self.optimizer_skips.double()]).tolist()
        loss_sum, finite, non_finite, streak, limit_at, last, skips = values
        self.loss_sum.zero_(), self.finite.zero_(), self.non_finite.zero_()
        return IntervalReading(mean_loss=loss_sum / finite if finite else math.nan, non_finite=int(non_finite),
                               nan_streak=int(streak), streak_limit_at=int(limit_at) or None,
                               last_finite_loss=None if math.isnan(last) else last, optimizer_skips=int(skips))
