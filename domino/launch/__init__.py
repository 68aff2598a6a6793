"""Launching ``domino pretrain`` as a Kubeflow PyTorchJob or Trainer v2 TrainJob, or locally with the environment
the job API's controller injects.

Public API::

    from domino.launch import JobSpec, run_job, JobResult

Rendering a job needs neither torch nor a cluster; the kubernetes client is imported only by the
``cluster`` backend. ``api`` picks a backend; the backends and ``api`` share ``outcome`` (how a job ended),
so no module here imports one that imports it back (tests/test_layering.py).

The public names are imported when first read (PEP 562 ``__getattr__``), not with the package: importing any
module here runs this file first, and the ones on a restart's path need none of them. The signal relay (the
container's first process, before torchrun) would otherwise import both backends, the job renderers and
:mod:`domino.config` (0.18 s), and every rank that reads the relay's grace period
(:mod:`domino.train.preemption`) would do the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers and readers; nothing imported at run time
    from domino.launch.api import run_job
    from domino.launch.outcome import JobResult
    from domino.launch.spec import JobSpec, LaunchSpecError, Toleration

__all__ = ["JobResult", "JobSpec", "LaunchSpecError", "Toleration", "run_job"]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use (and kept: later reads skip this)."""
    if name == "run_job":
        from domino.launch.api import run_job as value
    elif name == "JobResult":
        from domino.launch.outcome import JobResult as value
    elif name in ("JobSpec", "LaunchSpecError", "Toleration"):
        from domino.launch import spec
        value = getattr(spec, name)
    else:  # also how `from domino.launch import naming` finds a submodule not imported yet
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
