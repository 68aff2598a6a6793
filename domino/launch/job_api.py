"""The Kubernetes job APIs a :class:`~domino.launch.spec.JobSpec` can be rendered as, chosen in one place.

``--api pytorchjob`` (Kubeflow training operator v1, ``kubeflow.org/v1``) or ``--api trainjob`` (Kubeflow
Trainer v2, ``trainer.kubeflow.org/v1alpha1``). Callers pick a :class:`JobApi` by name and use only its
fields, so nothing outside the renderers depends on which API it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from domino.launch import render, trainjob
from domino.launch.spec import JobSpec

Renderer = Callable[[JobSpec, str, Optional[Dict[str, Any]]], Dict[str, Any]]


@dataclass(frozen=True)
class JobApi:
    """One job API: its custom resource coordinates and how a spec becomes an object of it."""

    name: str
    """The ``--api`` value."""
    group: str
    """API group of the custom resource."""
    version: str
    """API version of the custom resource."""
    plural: str
    """Resource name in URLs (``CustomObjectsApi`` plural)."""
    kind: str
    """The object's ``kind``."""
    render: Renderer
    """``render(spec, run_id, owner_reference)`` -> the object (validates the spec first)."""


JOB_APIS: Dict[str, JobApi] = {
    "pytorchjob": JobApi("pytorchjob", render.GROUP, render.VERSION, render.PLURAL, render.KIND, render.render_job),
    "trainjob": JobApi("trainjob", trainjob.GROUP, trainjob.VERSION, trainjob.PLURAL, trainjob.KIND,
                       trainjob.render_trainjob),
}
DEFAULT_JOB_API = "pytorchjob"


def job_api(name: str) -> JobApi:
    """The :class:`JobApi` called ``name``; raises ValueError naming ``--api`` for an unknown one."""
    if name not in JOB_APIS:
        raise ValueError(f"--api: {name!r} is not one of {', '.join(JOB_APIS)}")
    return JOB_APIS[name]
