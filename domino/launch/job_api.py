"""The Kubernetes job APIs a :class:`~domino.launch.spec.JobSpec` can run as, chosen in one place.

``--api pytorchjob`` (Kubeflow training operator v1, ``kubeflow.org/v1``) or ``--api trainjob`` (Kubeflow
Trainer v2, ``trainer.kubeflow.org/v1alpha1``). Callers pick a :class:`~domino.launch.job_api_base.JobApi`
by name and use only its interface, so nothing outside the two implementations depends on which API it is.
"""

from __future__ import annotations

from typing import Dict

from domino.launch.job_api_base import JobApi
from domino.launch.pytorchjob import PyTorchJobApi
from domino.launch.trainjob import TrainJobApi

JOB_APIS: Dict[str, JobApi] = {api.name: api for api in (PyTorchJobApi(), TrainJobApi())}
DEFAULT_JOB_API = "pytorchjob"


def job_api(name: str) -> JobApi:
    """The :class:`JobApi` called ``name``; raises ValueError naming ``--api`` for an unknown one."""
    if name not in JOB_APIS:
        raise ValueError(f"--api: {name!r} is not one of {', '.join(JOB_APIS)}")
    return JOB_APIS[name]


__all__ = ["DEFAULT_JOB_API", "JOB_APIS", "JobApi", "job_api"]
