"""What every launch backend shares: how a job ended (:class:`JobResult`), the cleanup policy, and the
signals that interrupt a launcher. Its own module, so that ``api.py`` and the backends it picks import it
rather than each other."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

#: What happens to the job when the launcher is done with it (see :func:`should_delete`).
CLEANUP_MODES = ("always", "on-success", "never")


@dataclass
class JobResult:
    """How a job ended.

    Attributes:
        name: the job's (per-run) name.
        succeeded: True only when the job reached Succeeded.
        phase: the last phase seen: Succeeded, Failed, Running, Pending, Restarting, Created, Suspended.
        reason: a readable explanation starting with a reason code (``BackoffLimitExceeded: ...``,
            ``SchedulingTimeout: ...``, ``Timeout: ...``, ``Interrupted: ...``); empty on success.
        log_tail: the Master's last log lines.
        exit_code: the Master container's exit code when known.
        failed_pods: on failure, each failed pod's name -> its ``pytorch`` container's last log lines.
    """

    name: str
    succeeded: bool
    phase: str
    reason: str
    log_tail: List[str] = field(default_factory=list)
    exit_code: Optional[int] = None
    failed_pods: Dict[str, List[str]] = field(default_factory=dict)

    def describe(self, lines: int = 20) -> str:
        """A multi-line summary for humans: outcome, reason and the last ``lines`` log lines."""
        head = f"job {self.name}: {self.phase}"
        if self.exit_code is not None:
            head += f" (exit code {self.exit_code})"
        out = [head]
        if self.reason:
            out.append(f"reason: {self.reason}")
        if not self.succeeded and self.log_tail:
            out.append(f"last {min(lines, len(self.log_tail))} log lines of the master:")
            out += ["  " + line for line in self.log_tail[-lines:]]
        for pod, tail in ([] if self.succeeded else sorted(self.failed_pods.items())):
            out.append(f"last {min(lines, len(tail))} log lines of failed pod {pod}:")
            out += ["  " + line for line in tail[-lines:]]
        return "\n".join(out)


class LaunchInterrupted(Exception):
    """Raised inside the launcher when SIGTERM/SIGINT arrives, so that cleanup runs before exiting."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received signal {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def interrupt_on_signals() -> Iterator[Callable[[], None]]:
    """Turns SIGTERM and SIGINT into :class:`LaunchInterrupted` while the block runs (main thread only).

    Yields a ``shield()`` callable: after calling it, further signals are recorded but no longer raise,
    so that cleanup (deleting the job, killing processes) runs to its end.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    shielded = []

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        if not shielded:
            raise LaunchInterrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield lambda: shielded.append(True)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def check_cleanup(cleanup: str) -> None:
    """Raises ValueError unless ``cleanup`` is one of :data:`CLEANUP_MODES`."""
    if cleanup not in CLEANUP_MODES:
        raise ValueError(f"--cleanup: {cleanup!r} is not one of {', '.join(CLEANUP_MODES)}")


def should_delete(cleanup: str, succeeded: bool, stopped: bool, outside_quota: bool = False) -> bool:
    """Whether to delete the job: ``always``; ``on-success`` after success or when the launcher stopped
    following it (interrupted, timed out, never scheduled); ``never``.

    A job the launcher gives up on is deleted unless told ``never``: nobody would otherwise stop the pods
    holding (or waiting for) the GPUs. A Failed job is kept by ``on-success`` for debugging. A job asked
    to queue that no queue manages (``outside_quota``, ``NotQueued``) is deleted whatever the mode: kept,
    it would run on GPUs its queue never granted.
    """
    if cleanup == "always" or outside_quota:
        return True
    if cleanup == "on-success":
        return succeeded or stopped
    return False
