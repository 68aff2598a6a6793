"""Named wall-clock timers for the training loop (``--timing-log-level``)."""

from __future__ import annotations

import time
from typing import Dict, List

import torch


class Timers:
    """Accumulating timers; each is enabled only when its level is <= ``--timing-log-level``.

    On GPUs a timer synchronises the device at start and stop so it measures work, not launches;
    that costs throughput, which is why timers beyond level 1 are opt-in.
    """

    LEVELS = {"batch-generator": 1, "forward-backward": 1, "optimizer": 1, "comm-wait": 1, "comm-modelled": 1,
              "forward": 2, "backward": 2}

    def __init__(self, log_level: int) -> None:
        self.log_level = log_level
        self.elapsed: Dict[str, float] = {}
        self._started: Dict[str, float] = {}

    def enabled(self, name: str) -> bool:
        """Whether timer ``name`` records at this log level."""
        return self.LEVELS.get(name, 2) <= self.log_level

    def start(self, name: str) -> None:
        """Starts timer ``name`` (no-op when disabled)."""
        if self.enabled(name):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        """Stops timer ``name`` and adds the interval to its total."""
        if name in self._started:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.elapsed[name] = self.elapsed.get(name, 0.0) + time.perf_counter() - self._started.pop(name)

    def add(self, name: str, seconds: float) -> None:
        """Adds ``seconds`` measured elsewhere to timer ``name`` (no-op when disabled)."""
        if self.enabled(name):
            self.elapsed[name] = self.elapsed.get(name, 0.0) + seconds

    def pop_all(self) -> Dict[str, float]:
        """Returns and resets the accumulated totals (seconds)."""
        out, self.elapsed = self.elapsed, {}
        return out

    @staticmethod
    def format(totals: Dict[str, float], iterations: int) -> str:
        """One line of per-iteration milliseconds: ``forward: 12.3 | backward: 20.1``."""
        parts: List[str] = [f"{k}: {1000 * v / max(iterations, 1):.1f}" for k, v in sorted(totals.items())]
        return "time (ms/iter) " + " | ".join(parts) if parts else ""


class TimedIterator:
    """Wraps a data iterator so time spent waiting for batches lands in the ``batch-generator`` timer."""

    def __init__(self, iterator, timers: Timers) -> None:
        self.iterator, self.timers = iterator, timers

    def __iter__(self):
        return self

    def __next__(self):
        self.timers.start("batch-generator")
        try:
            return next(self.iterator)
        finally:
            self.timers.stop("batch-generator")
