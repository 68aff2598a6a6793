"""Launching ``domino pretrain`` as a Kubeflow PyTorchJob or Trainer v2 TrainJob, or locally with the environment
the job API's controller injects.

Public API::

    from domino.launch import JobSpec, run_job, JobResult

Rendering a job needs neither torch nor a cluster; the kubernetes client is imported only by the
``cluster`` backend. ``api`` picks a backend; the backends and ``api`` share ``outcome`` (how a job ended),
so no module here imports one that imports it back (tests/test_layering.py).
"""

from domino.launch.api import run_job
from domino.launch.outcome import JobResult
from domino.launch.spec import JobSpec, LaunchSpecError, Toleration

__all__ = ["JobResult", "JobSpec", "LaunchSpecError", "Toleration", "run_job"]
