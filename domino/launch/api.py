"""The launch API used by ``domino launch submit`` and the pipeline's pretrain component.

``run_job(spec)`` runs a :class:`~domino.launch.spec.JobSpec` to completion on a backend and returns a
:class:`JobResult`; it fails (``succeeded=False``) on a failed job, on a scheduling timeout, on the
overall timeout and when interrupted, and succeeds only when the job Succeeded.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

from domino.launch.job_api import DEFAULT_JOB_API
from domino.launch.spec import JobSpec

#: Where a job runs: ``cluster`` (the Kubernetes API of the in-cluster config or kubeconfig) or
#: ``local`` (each node a process on this machine); the job API (``api``) is a separate choice.
BACKENDS = ("cluster", "local")
CLEANUP_MODES = ("always", "on-success", "never")
#: How long a ``--queue`` job may wait for Kueue's admission by default: finite, so that a queue that
#: never admits it (no quota, a ClusterQueue that is stopped) fails the run instead of hanging it, and
#: long, because a busy GPU queue may legitimately hold a job for hours.
DEFAULT_QUEUE_TIMEOUT_S = 24 * 3600


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


def should_delete(cleanup: str, succeeded: bool, stopped: bool) -> bool:
    """Whether to delete the job: ``always``; ``on-success`` after success or when the launcher stopped
    following it (interrupted, timed out, never scheduled); ``never``.

    A job the launcher gives up on is deleted unless told ``never``: nobody would otherwise stop the pods
    holding (or waiting for) the GPUs. A Failed job is kept by ``on-success`` for debugging.
    """
    if cleanup == "always":
        return True
    if cleanup == "on-success":
        return succeeded or stopped
    return False


def run_job(
    spec: JobSpec,
    backend: str = "cluster",
    *,
    api: str = DEFAULT_JOB_API,
    timeout_s: Optional[float] = None,
    scheduling_timeout_s: float = 600,
    queue_timeout_s: Optional[float] = DEFAULT_QUEUE_TIMEOUT_S,
    cleanup: str = "on-success",
    run_id: Optional[str] = None,
    log: Callable[[str], None] = print,
    workdir: Optional[str] = None,
) -> JobResult:
    """Runs ``spec`` to completion and returns how it ended.

    Args:
        spec: the job.
        backend: ``cluster`` (via the kubernetes client, in-cluster config or kubeconfig) or ``local``
            (each node a process on this machine with the environment ``api``'s controller injects,
            see local_backend).
        api: the job API, ``pytorchjob`` or ``trainjob`` (see domino.launch.job_api).
        timeout_s: wall-clock limit for the whole job (None: no limit); also the job's
            ``activeDeadlineSeconds`` unless the spec sets one, so the cluster stops it without us.
        scheduling_timeout_s: fail when the job (once admitted) has not started Running, or not all of
            its pods run, after this many seconds.
        queue_timeout_s: fail when a job queued in Kueue (suspended) is not admitted after this many
            seconds (default :data:`DEFAULT_QUEUE_TIMEOUT_S`; None: wait as long as ``timeout_s`` allows).
        cleanup: ``always``, ``on-success`` or ``never`` (see :func:`should_delete`).
        run_id: identifies the run (same id -> same job name -> a retry adopts its own job);
            default: a fresh random id.
        log: receives the Master's log lines and status messages.
        workdir: local backend only: the directory standing in for the shared volume.

    Raises:
        LaunchSpecError: invalid ``spec`` or ``domino pretrain`` arguments (before anything is created).
        ValueError: unknown ``backend``, ``api`` or ``cleanup``.
    """
    from domino.launch.job_api import job_api
    from domino.launch.pretrain_args import check_pretrain_args

    check_cleanup(cleanup)
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    job_kind = job_api(api)
    spec.validate()
    job_kind.check(spec)
    check_pretrain_args(spec)
    if timeout_s is not None and spec.active_deadline_seconds is None:
        spec = dataclasses.replace(spec, active_deadline_seconds=max(1, math.ceil(timeout_s)))
    if backend == "cluster":
        from domino.launch.kube_backend import JobLauncher

        return JobLauncher(job_kind, log=log).run(
            spec, run_id=run_id, timeout_s=timeout_s, scheduling_timeout_s=scheduling_timeout_s, cleanup=cleanup,
            queue_timeout_s=queue_timeout_s)
    from domino.launch.local_backend import LocalLauncher

    return LocalLauncher(job_kind, log=log).run(spec, run_id=run_id, timeout_s=timeout_s, workdir=workdir)
