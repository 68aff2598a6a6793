"""What the launcher needs to know about a Kubernetes job API, as one interface (no API is named here).

A :class:`JobApi` says how a :class:`~domino.launch.spec.JobSpec` becomes an object of the API, how
that object's status reads in the launcher's terms (:class:`JobState`), how the job's training pods
are found and which of them is rank 0, which objects carry the events that explain a stuck job, and
which environment the API's controller gives each node (so the local backend can reproduce it). The
cluster backend, the local backend, the CLI and the pipeline use only this interface; the registry of
implementations is :mod:`domino.launch.job_api`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from domino.launch.spec import JobSpec

#: The launcher's phases, most decisive first: a job in several at once is in the first.
PHASES = ("Succeeded", "Failed", "Suspended", "Restarting", "Running", "Created")
#: Phases in which the job's pods have started.
STARTED_PHASES = ("Running", "Restarting", "Succeeded", "Failed")


@dataclass
class JobState:
    """One observation of a job's status, in the launcher's terms."""

    phase: Optional[str]
    """One of :data:`PHASES`, or None when the status says nothing yet."""
    suspended: bool = False
    """The job is held suspended (waiting in a Kueue queue)."""
    conditions: List[Dict[str, str]] = field(default_factory=list)
    """The conditions to report (``type``, ``status``, ``reason``, ``message``), as the API names them."""
    failure: str = ""
    """``Reason: message`` of the failure when ``phase`` is Failed."""


class JobApi(ABC):
    """One job API (a custom resource and the controller behind it)."""

    name: str
    """The ``--api`` / ``job_api`` value."""
    group: str
    """API group of the custom resource."""
    version: str
    """API version of the custom resource."""
    plural: str
    """Resource name in URLs (``CustomObjectsApi`` plural, RBAC resource)."""
    kind: str
    """The object's ``kind``."""
    container: str
    """Name of the training container in every pod of the job (its log is the job's log)."""

    @abstractmethod
    def render(self, spec: JobSpec, run_id: str, owner_reference: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The object for ``spec`` in run ``run_id``; validates the spec (and :meth:`check`) first."""

    def check(self, spec: JobSpec) -> None:
        """Raises :class:`~domino.launch.spec.LaunchSpecError` for settings this API cannot carry."""

    @abstractmethod
    def state(self, job: Dict[str, Any]) -> JobState:
        """The job object's status (and suspension) in the launcher's terms."""

    @abstractmethod
    def pod_selector(self, job_name: str) -> str:
        """Label selector of the job's training pods."""

    @abstractmethod
    def rank0_pod(self, pods: List[Dict[str, Any]], job_name: str) -> Optional[Dict[str, Any]]:
        """The pod of node rank 0 (the rendezvous master, whose log is followed) among ``pods``."""

    def event_objects(self, job_name: str) -> List[str]:
        """Names of the objects (besides the pods) whose Warning events explain a job that does not run."""
        return [job_name]

    @abstractmethod
    def node_names(self, job_name: str, nodes: int) -> List[str]:
        """The pods' names (host names) in node-rank order."""

    @abstractmethod
    def node_env(self, spec: JobSpec, job_name: str, node_rank: int, master_port: int) -> Dict[str, str]:
        """What the controller injects into node ``node_rank``'s training container, plus the spec's env,
        with the master at 127.0.0.1:``master_port`` (the local backend's one difference)."""

    @abstractmethod
    def backoff_limit(self, spec: JobSpec) -> int:
        """Container restarts, summed over the job's pods, after which the job Fails (restart policy OnFailure)."""


def highest_phase(phases) -> Optional[str]:
    """The most decisive of ``phases`` per :data:`PHASES`, or None."""
    present = set(phases)
    return next((p for p in PHASES if p in present), None)
