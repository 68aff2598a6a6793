"""The Kubeflow training operator v1 PyTorchJob (``kubeflow.org/v1``) as a :class:`~domino.launch.job_api_base.JobApi`.

Read from the operator's source (kubeflow/trainer branch release-1.9 = training-operator v1.9.x):

* status: conditions Created, Running, Restarting, Succeeded, Suspended, Failed (``pkg/apis/kubeflow.org/v1``
  ``common_types.go``); Kueue holds a queued job with ``spec.runPolicy.suspend``;
* pods: labelled ``training.kubeflow.org/job-name`` and ``training.kubeflow.org/replica-type``
  (``pkg/controller.v1/common/pod.go``), named ``<job>-master-0`` and ``<job>-worker-<i>``;
* environment (``pkg/controller.v1/pytorch/envvar.go``): see :meth:`PyTorchJobApi.node_env`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from domino.launch import defaults, naming, render
from domino.launch.job_api_base import JobApi, JobState, highest_phase
from domino.launch.spec import CONTAINER_NAME, JobSpec


class PyTorchJobApi(JobApi):
    """``--api pytorchjob``: one Master and ``nodes - 1`` Workers."""

    name, group, version, plural, kind = "pytorchjob", render.GROUP, render.VERSION, render.PLURAL, render.KIND
    container = CONTAINER_NAME

    def render(self, spec: JobSpec, run_id: str, owner_reference: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        return render.render_job(spec, run_id, owner_reference)

    def state(self, job: Dict[str, Any]) -> JobState:
        conditions = (job.get("status") or {}).get("conditions") or []
        true = [c.get("type") for c in conditions if c.get("status") == "True"]
        failed = next((c for c in conditions if c.get("type") == "Failed"), {})
        return JobState(
            phase=highest_phase(true),
            suspended=bool(((job.get("spec") or {}).get("runPolicy") or {}).get("suspend")),
            conditions=list(conditions),
            failure=f"{failed.get('reason') or 'Failed'}: {failed.get('message', 'the job failed')}")

    def pod_selector(self, job_name: str) -> str:
        return f"{naming.OPERATOR_JOB_LABEL}={job_name}"

    def rank0_pod(self, pods: List[Dict[str, Any]], job_name: str) -> Optional[Dict[str, Any]]:
        for pod in pods:
            labels = pod.get("metadata", {}).get("labels") or {}
            if labels.get(naming.OPERATOR_REPLICA_TYPE_LABEL, "").lower() == "master":
                return pod
        return next((p for p in pods if p.get("metadata", {}).get("name") == f"{job_name}-master-0"), None)

    def node_names(self, job_name: str, nodes: int) -> List[str]:
        return [f"{job_name}-master-0"] + [f"{job_name}-worker-{i}" for i in range(nodes - 1)]

    def node_env(self, spec: JobSpec, job_name: str, node_rank: int, master_port: int) -> Dict[str, str]:
        """The operator's variables (master ``<job>-master-0``:23456 in the cluster; WORLD_SIZE counts
        pods when nprocPerNode is not an integer), ``DOMINO_JOB_NAME`` and the container's env
        (:func:`domino.launch.defaults.environment`)."""
        nproc = spec.nproc_per_node
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master_port),
            "WORLD_SIZE": str(spec.nodes * nproc if isinstance(nproc, int) else spec.nodes),
            "RANK": str(node_rank),
            "PET_NNODES": str(spec.nodes),
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(node_rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(master_port),
            "PYTHONUNBUFFERED": "1",
            "DOMINO_JOB_NAME": job_name,
        }
        env.update({k: str(v) for k, v in defaults.environment(spec).items()})  # what the rendered pod sets
        return env

    def backoff_limit(self, spec: JobSpec) -> int:
        return defaults.backoff_limit(spec)
