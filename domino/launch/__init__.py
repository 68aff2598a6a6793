"""Launching ``domino pretrain`` as a Kubeflow PyTorchJob, or locally with the operator's environment.

Public API::

    from domino.launch import JobSpec, run_job, JobResult

Rendering a job needs neither torch nor a cluster; the kubernetes client is imported only by the
``pytorchjob`` backend.
"""

from domino.launch.api import JobResult, run_job
from domino.launch.spec import JobSpec, LaunchSpecError, Toleration

__all__ = ["JobResult", "JobSpec", "LaunchSpecError", "Toleration", "run_job"]
