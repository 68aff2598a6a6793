"""Test hooks of the checkpoint writer, driven by ``DOMINO_FAULT_INJECT`` (unset in every real run): the kill and
slow-save points the fault tests use to cut a save short with real signals at an exact moment."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)


def maybe_inject_fault(point: str, iteration: int, partial: Optional[Callable[[], None]] = None) -> None:
    """Test hook: ``DOMINO_FAULT_INJECT=POINT@N`` SIGKILLs rank 0 at ``POINT`` while saving iteration N.

    ``kill-in-save`` is after every file is written and before the commit; ``kill-in-delete`` is halfway
    through removing a replaced or pruned checkpoint (``partial`` has done the first half). The kill/resume
    tests use them to prove that a save cut short never leaves a run that cannot resume.
    """
    spec = os.environ.get("DOMINO_FAULT_INJECT", "")
    if spec == f"{point}@{iteration}" and (not dist.is_initialized() or dist.get_rank() == 0):
        if partial is not None:
            partial()
        logger.warning("fault injection: killing this process in %s at iteration %d", point, iteration)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_slow_down() -> None:
    """Test hook: ``DOMINO_FAULT_INJECT=slow-save:SECONDS`` makes rank 0 take SECONDS longer before each commit,
    like a save to a slow volume (the SIGTERM test needs one longer than torchrun's default 30 s)."""
    spec = os.environ.get("DOMINO_FAULT_INJECT", "")
    if spec.startswith("slow-save:") and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("fault injection: this save takes %s s longer", spec.split(":", 1)[1])
        time.sleep(float(spec.split(":", 1)[1]))
