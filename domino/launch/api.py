"""The launch API used by ``domino launch submit`` and the pipeline's pretrain component.

``run_job(spec)`` runs a :class:`~domino.launch.spec.JobSpec` to completion on a backend and returns a
:class:`~domino.launch.outcome.JobResult`; it fails (``succeeded=False``) on a failed job, on a scheduling
timeout, on the overall timeout and when interrupted, and succeeds only when the job Succeeded. The backends
(``kube_backend``, ``local_backend``) import the shared result types from ``outcome``, never this module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Union

from domino.launch.job_api import DEFAULT_JOB_API, job_api
from domino.launch.kube_backend import JobLauncher
from domino.launch.local_backend import LocalLauncher
from domino.launch.outcome import CLEANUP_MODES, JobResult, check_cleanup
from domino.launch.pretrain_args import ResolvedPretrain, resolve_pretrain
from domino.launch.spec import JobSpec

__all__ = ["BACKENDS", "CLEANUP_MODES", "DEFAULT_QUEUE_TIMEOUT_S", "run_job"]

#: Where a job runs: ``cluster`` (the Kubernetes API of the in-cluster config or kubeconfig) or
#: ``local`` (each node a process on this machine); the job API (``api``) is a separate choice.
BACKENDS = ("cluster", "local")
#: How long a ``--queue`` job may wait for Kueue's admission by default: finite, so that a queue that
#: never admits it (no quota, a ClusterQueue that is stopped) fails the run instead of hanging it, and
#: long, because a busy GPU queue may legitimately hold a job for hours.
DEFAULT_QUEUE_TIMEOUT_S = 24 * 3600


def run_job(
    spec: Union[JobSpec, ResolvedPretrain],
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
    api_client=None,
) -> JobResult:
    """Runs ``spec`` to completion and returns how it ended.

    Args:
        spec: the job, or the job as :func:`~domino.launch.pretrain_args.resolve_pretrain` resolved it (its layout
            derived and its pretrain arguments checked once: not again here).
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
        api_client: cluster backend only: a ``kubernetes`` ApiClient (default: in-cluster, else kubeconfig).

    Raises:
        LaunchSpecError: invalid ``spec`` or ``domino pretrain`` arguments (before anything is created).
        ValueError: unknown ``backend``, ``api`` or ``cleanup``.
    """
    check_cleanup(cleanup)
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    job_kind = job_api(api)
    given = spec.spec if isinstance(spec, ResolvedPretrain) else spec
    given.validate()
    job_kind.check(given)
    # The pods' argv: the layout derived and the config checked once, here or already by the caller.
    resolved = spec if isinstance(spec, ResolvedPretrain) else resolve_pretrain(given)
    spec = resolved.spec
    if resolved.derived is not None:
        log(f"parallel layout derived for {resolved.derived.why}")
    if timeout_s is not None and spec.active_deadline_seconds is None:
        spec = dataclasses.replace(spec, active_deadline_seconds=max(1, math.ceil(timeout_s)))
    if backend == "cluster":
        return JobLauncher(job_kind, api_client=api_client, log=log).run(
            spec, run_id=run_id, timeout_s=timeout_s, scheduling_timeout_s=scheduling_timeout_s, cleanup=cleanup,
            queue_timeout_s=queue_timeout_s)
    return LocalLauncher(job_kind, log=log).run(spec, run_id=run_id, timeout_s=timeout_s, workdir=workdir)
