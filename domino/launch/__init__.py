"""Launching ``domino pretrain`` as a Kubeflow PyTorchJob or Trainer v2 TrainJob, or locally with the environment
the job API's controller injects.

Public API::

    from domino.launch import JobSpec, run_job, JobResult

Rendering a job needs neither torch nor a cluster; the kubernetes client is imported only by the
``cluster`` backend.
"""

from domino.launch.api import JobResult, run_job
from domino.launch.spec import JobSpec, LaunchSpecError, Toleration

__all__ = ["JobResult", "JobSpec", "LaunchSpecError", "Toleration", "run_job"]
