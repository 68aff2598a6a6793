"""Test hook of the training step, driven by ``DOMINO_FAULT_INJECT`` (unset in every real run; the checkpoint
writer's kill points are :mod:`domino.checkpoint.fault_hooks`).

``DOMINO_FAULT_INJECT=raise-in-step@N:R``: rank R raises :class:`InjectedFault` at the start of its step N, once
per process and only in a job's first torchrun round (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted worker
does not fail again at the same step. Its peers are then left blocked in the step's first collective: the way to
rehearse an in-process restart (``--inprocess-restart``) and to compare it with a torchrun restart.

``DOMINO_FAULT_INJECT=kill-in-step@N:R``: the same moment, but rank R's process dies (SIGKILL): a dead process,
which no in-process restart can bring back; the launcher's restart (torchrun's ``--max-restarts``, the pod's
policy) must.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

#: Whether this process raised already (a process-wide fact: the fault fires once per process).
_FIRED = []


class InjectedFault(RuntimeError):
    """The exception ``DOMINO_FAULT_INJECT=raise-in-step@N:R`` raises."""


def maybe_raise_in_step(iteration: int, rank: int) -> None:
    """Raises :class:`InjectedFault` (or dies) when ``DOMINO_FAULT_INJECT`` asks rank ``rank`` to fail in step
    ``iteration``."""
    spec = os.environ.get("DOMINO_FAULT_INJECT", "")
    if _FIRED or not spec.endswith(f"-in-step@{iteration}:{rank}") or os.environ.get(
            "TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if spec == f"kill-in-step@{iteration}:{rank}":
        logger.warning("fault injection: rank %d (pid %d) dies in its step %d", rank, os.getpid(), iteration)
        os.kill(os.getpid(), signal.SIGKILL)
    if spec != f"raise-in-step@{iteration}:{rank}":
        return
    _FIRED.append(iteration)
    logger.warning("fault injection: rank %d (pid %d) raises in its step %d", rank, os.getpid(), iteration)
    raise InjectedFault(f"injected fault in step {iteration} on rank {rank} (DOMINO_FAULT_INJECT={spec})")
