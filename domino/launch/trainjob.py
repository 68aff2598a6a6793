"""Renders a :class:`~domino.launch.spec.JobSpec` as a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1).

A TrainJob carries only what varies per job; the pod shape lives in the TrainingRuntime that ``k8s/trainer``
ships (:data:`RUNTIME_NAME`: the domino image, the shared volume at :data:`RUNTIME_PVC`, /dev/shm, the
restricted security context). What goes where, per the v2.3.0 CRD (``../shared/schemas/trainer-v2.3.0``):

* ``spec.trainer``: numNodes, numProcPerNode, resourcesPerNode (GPUs included), image, command, env;
* ``spec.runtimePatches`` (one entry owned by :data:`PATCH_MANAGER`): labels/annotations, nodeSelector,
  tolerations, imagePullSecrets, serviceAccountName, terminationGracePeriodSeconds, and, when they differ
  from the runtime's, the claim and /dev/shm volumes and the ``node`` container's mount. v2.3.0 applies
  each patch to the runtime's JobSet spec as a strategic merge patch (``pkg/runtime/core/trainingruntime.go``
  ``mergeRuntimePatches``), so volumes merge by name (``merge,retainKeys``) and mounts by mountPath;
  its webhook allows volumes and the ``node`` container's volumeMounts (``plugins/jobset`` ``Validate``:
  only env is refused for that container);
* the Kueue queue label with ``--queue`` (Kueue's webhook sets ``spec.suspend``, see
  :func:`domino.launch.render.job_metadata`); ``spec.activeDeadlineSeconds``.

The container runs the same ``torchrun -m domino pretrain ...`` as the PyTorchJob: torchrun reads the
``PET_*`` variables (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT)
that the Trainer's torch plugin injects into the ``node`` container (kubeflow/trainer
``pkg/runtime/framework/plugins/torch/torch.go``, ``EnforceMLPolicy``), which is also why ``--env`` may
not set them (the plugin's ``Validate`` rejects reserved names).

Settings the TrainJob API has no field for are refused with the flag's name rather than dropped
silently (see :func:`check_trainjob_spec`).

Following a TrainJob (:class:`TrainJobApi`), read from kubeflow/trainer v2.3.0 and what it builds on:

* conditions (``pkg/apis/trainer/v1alpha1/trainjob_types.go``): only ``Suspended`` (reasons Suspended /
  Resumed, ``pkg/controller/trainjob_controller.go`` ``setSuspendedCondition``), ``Complete`` and
  ``Failed``, both copied from the JobSet's Completed/Failed conditions with the JobSet's reason and
  message (``pkg/runtime/framework/plugins/jobset/jobset.go`` ``Status``; jobset v0.12.0 reasons
  ``AllJobsCompleted``, ``FailedJobs``, ``ReachedMaxRestarts``, ...), or set by the controller itself:
  ``DeadlineExceeded`` (``spec.activeDeadlineSeconds``), ``TrainingRuntimeNotSupported``. There is no
  Created and no Running condition: the job is *created* once ``status.jobsStatus`` reports the JobSet's
  replicated jobs and *running* once the ``node`` Job is ready (all its pods ready or done; its
  ``active`` count includes pending pods), as Kueue's ``PodsReady`` reads it (kubernetes-sigs/kueue
  v0.19.2 ``pkg/controller/jobs/trainjob/trainjob_controller.go``; ``IsSuspended`` reads
  ``spec.suspend``, ``Finished`` reads Complete/Failed).
* pods: the JobSet (named like the TrainJob) runs one Job ``<job>-node-0`` with ``numNodes`` indexed
  pods (trainer ``plugins/jobset`` ``SyncParallelCount``, ``Builder.Trainer``: replicas 1), labelled
  ``jobset.sigs.k8s.io/jobset-name`` and ``jobset.sigs.k8s.io/replicatedjob-name`` (jobset v0.12.0
  ``pkg/controllers/jobset_controller.go`` ``labelAndAnnotateObject``, the selector Kueue's
  ``PodLabelSelector`` uses) and ``batch.kubernetes.io/job-completion-index`` (Kubernetes
  ``pkg/controller/job/indexed_job_utils.go``), named ``<job>-node-0-<index>-<random>``. Index 0 is
  the master: ``PET_MASTER_ADDR`` is ``<job>-node-0-0.<job>``.
* a TrainJob whose runtime is missing is refused at creation by the validating webhook
  ``validator.trainjob.trainer.kubeflow.org`` (``pkg/runtime/core/trainingruntime.go`` ``ValidateObjects``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from domino.launch import defaults, naming
from domino.launch.job_api_base import JobApi, JobState, highest_phase
from domino.launch.render import (ISTIO_INJECT, container_security, job_metadata, kube_command, metrics_port,
                                   pod_placement, resources)
from domino.launch.spec import DEFAULT_MOUNT_PATH, JobSpec, LaunchSpecError

API_VERSION = "trainer.kubeflow.org/v1alpha1"
KIND = "TrainJob"
GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
#: The namespaced TrainingRuntime shipped in ``k8s/trainer`` (same namespace as the job and the PVC).
RUNTIME_NAME = "domino-torch-distributed"
RUNTIME_KIND = "TrainingRuntime"
#: The claim, mount path and /dev/shm size baked into that runtime's pod template.
RUNTIME_PVC, RUNTIME_MOUNT_PATH, RUNTIME_SHM_SIZE = "domino-data", DEFAULT_MOUNT_PATH, "16Gi"
#: The runtime's terminationGracePeriodSeconds (the JobSpec default), what a queued TrainJob gets.
RUNTIME_GRACE_PERIOD_S = 180
#: The replicated job and container the torch plugin configures (``constants.Node`` upstream).
NODE = "node"
#: ``manager`` of our runtime patch (the list is keyed by manager; Kueue uses ``kueue.x-k8s.io/manager``).
PATCH_MANAGER = "domino.launch/renderer"
#: Environment the torch plugin owns: ``TorchRunReservedEnvNames`` (kubeflow/trainer ``pkg/constants/constants.go``),
#: which torch.go ``Validate`` refuses in ``trainer.env``.
#: The port k8s/trainer's runtime declares as `metrics` on the node container (``--metrics-port`` of a TrainJob).
RUNTIME_METRICS_PORT = 9400
RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def check_trainjob_spec(spec: JobSpec) -> None:
    """Raises :class:`LaunchSpecError` for settings a v2.3.0 TrainJob cannot carry.

    The runtime patches of v2.3.0 (``PodSpecPatch``) cannot set ``priorityClassName``; restarts and pod
    cleanup are the runtime's JobSet policies, which no TrainJob field reaches (``JobSetSpecPatch`` holds
    only replicatedJobs, ``JobSpecPatch`` only the pod template); and a queued TrainJob keeps only the
    runtime's grace period: Kueue v0.19.2 is built against trainer v2.2.1, whose ``PodSpecPatch`` has no
    ``terminationGracePeriodSeconds``, and rewrites the TrainJob from that type when it admits it
    (``pkg/controller/jobs/trainjob/trainjob_controller.go`` ``RunWithPodSetsInfo``: ``c.Update``).
    """
    problems: List[str] = []

    def refuse(bad: bool, flag: str, why: str) -> None:
        if bad:
            problems.append(f"{flag}: {why}")

    refuse(isinstance(spec.nproc_per_node, str) and spec.nproc_per_node != "auto", "--nproc-per-node",
           f"{spec.nproc_per_node!r}: a TrainJob takes an integer or auto (numProcPerNode is int32 in v2.3.0)")
    refuse(spec.priority_class is not None, "--priority-class", "runtime patches cannot set priorityClassName")
    refuse(spec.restart_policy != "OnFailure", "--restart-policy", "restarts follow the runtime's JobSet "
           f"failurePolicy (maxRestarts {defaults.JOBSET_MAX_RESTARTS}: the whole set is recreated per fault)")
    refuse(spec.backoff_limit is not None, "--backoff-limit", "no TrainJob field reaches the runtime's JobSet "
           f"failurePolicy (maxRestarts {defaults.JOBSET_MAX_RESTARTS}); edit k8s/trainer for another limit")
    refuse(bool(spec.queue) and spec.termination_grace_period_s != RUNTIME_GRACE_PERIOD_S, "--termination-grace-period",
           f"Kueue v0.19.2 drops a queued TrainJob's grace period at admission, so the runtime's "
           f"{RUNTIME_GRACE_PERIOD_S} s applies; edit k8s/trainer for another")
    refuse(spec.clean_pod_policy != "Running", "--clean-pod-policy", "a TrainJob has no pod cleanup policy")
    refuse(spec.scheduling_policy, "--scheduling-policy", "use the runtime's podGroupPolicy for gang scheduling")
    # trainer v2.3.0's TrainJob has .spec.trainer.env (valueFrom included) but no envFrom, and a runtime
    # patch may not set env of the `node` container (trainer.kubeflow.org_trainjobs.yaml, ContainerPatch.env).
    refuse(bool(spec.env_from_secrets), "--env-from-secret", "a TrainJob cannot take envFrom (trainer v2.3.0 has "
           "no such field for the trainer); name each variable with --env-secret NAME=SECRET:KEY")
    # ContainerPatch has no ports (trainjob_types.go), so the runtime declares the one port named `metrics`
    # that k8s/metrics's NetworkPolicy admits Prometheus on.
    port = metrics_port(spec)
    refuse(port is not None and port != RUNTIME_METRICS_PORT, "--metrics-port", f"{port}: a TrainJob cannot "
           f"declare ports; the runtime declares {RUNTIME_METRICS_PORT} as `metrics` (edit k8s/trainer for another)")
    reserved = sorted((set(spec.env) | set(spec.secret_env)) & set(RESERVED_ENV))
    refuse(bool(reserved), "--env", f"{', '.join(reserved)} are set by the Trainer's torch plugin")
    if problems:
        raise LaunchSpecError("invalid job spec for --api trainjob: " + "; ".join(problems))


def _volume_patch(spec: JobSpec) -> Dict[str, Any]:
    """Volumes and the ``node`` container's mount where the spec differs from the runtime's (else nothing)."""
    out: Dict[str, Any] = {}
    volumes = []
    if spec.pvc != RUNTIME_PVC:
        volumes.append({"name": "domino-data", "persistentVolumeClaim": {"claimName": spec.pvc}})
    if spec.shm_size != RUNTIME_SHM_SIZE:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", **(
            {"sizeLimit": spec.shm_size} if spec.shm_size else {})}})
    if volumes:
        out["volumes"] = volumes
    container: Dict[str, Any] = {}
    if spec.mount_path != RUNTIME_MOUNT_PATH:  # mounts merge by mountPath: the runtime's stays, this one is added
        container["volumeMounts"] = [{"name": "domino-data", "mountPath": spec.mount_path}]
    if spec.rdma_resources:  # the fast network: the runtime's securityContext with IPC_LOCK added
        container["securityContext"] = container_security(spec)
    if container:
        out["containers"] = [{"name": NODE, **container}]
    return out


def _pod_patch(spec: JobSpec, labels: Dict[str, str]) -> Dict[str, Any]:
    """The pod template patch for the ``node`` replicated job (see the module docstring)."""
    pod = {"terminationGracePeriodSeconds": spec.termination_grace_period_s, **pod_placement(spec),
           **_volume_patch(spec)}
    metadata = {"labels": {ISTIO_INJECT: "false", **labels}, "annotations": {ISTIO_INJECT: "false", **spec.annotations}}
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": NODE, "template": {"spec": {"template": {"metadata": metadata, "spec": pod}}}}]}}}}


def render_trainjob(spec: JobSpec, run_id: str, owner_reference: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The TrainJob object for ``spec`` in run ``run_id`` (validated first).

    Args:
        spec: the job description.
        run_id: identifies the run; determines the job name and the ``domino/run-id`` label.
        owner_reference: an ``ownerReferences`` entry (the launching pod), if any.

    Raises:
        LaunchSpecError: when ``spec`` is invalid or asks for what a TrainJob cannot carry.
    """
    spec.validate()
    check_trainjob_spec(spec)
    name = naming.job_name(spec.name, run_id, spec.nodes)
    labels = {**spec.labels, **naming.run_labels(run_id, spec.owner, name)}
    env = {"DOMINO_JOB_NAME": name, **defaults.environment(spec)}
    trainer: Dict[str, Any] = {
        "image": spec.image,
        "command": kube_command(spec, name),
        "numNodes": spec.nodes,
        "resourcesPerNode": resources(spec),
        "env": [{"name": k, "value": str(v)} for k, v in env.items()] + defaults.secret_environment(spec),
    }
    if isinstance(spec.nproc_per_node, int):
        trainer["numProcPerNode"] = spec.nproc_per_node  # else "auto": the torch plugin's default
    job_spec: Dict[str, Any] = {
        "runtimeRef": {"apiGroup": GROUP, "kind": RUNTIME_KIND, "name": RUNTIME_NAME},
        "trainer": trainer,
        "runtimePatches": [_pod_patch(spec, labels)],
    }
    if spec.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = spec.active_deadline_seconds
    metadata = job_metadata(spec, name, run_id, labels, owner_reference)
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": job_spec}


#: Labels the JobSet controller (jobset v0.12.0) and the Job controller put on every pod of the job.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
#: The torch plugin's master port (``constants.ContainerTrainerPort``).
MASTER_PORT = 29500
#: The runtime's node Job: ``backoffLimit: 0`` and pods ``restartPolicy: Never``, so a failed pod fails
#: its Job at once and the JobSet's failurePolicy recreates every pod (a fresh rendezvous), up to
#: ``failurePolicy.maxRestarts`` = :data:`domino.launch.defaults.JOBSET_MAX_RESTARTS` times.
RUNTIME_JOB_BACKOFF_LIMIT = 0


def _cpu_ceil(quantity: str) -> int:
    """A CPU quantity rounded up to whole cores, as resource.Quantity.Value() does."""
    text = str(quantity)
    if text.endswith("m"):
        return math.ceil(int(text[:-1]) / 1000)
    try:
        return math.ceil(float(text))
    except ValueError:
        return 0


class TrainJobApi(JobApi):
    """``--api trainjob``: a Kubeflow Trainer v2.3 TrainJob on the ``k8s/trainer`` runtime (see the module docstring)."""

    name, group, version, plural, kind, container = "trainjob", GROUP, VERSION, PLURAL, KIND, NODE

    def render(self, spec: JobSpec, run_id: str, owner_reference: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        return render_trainjob(spec, run_id, owner_reference)

    def check(self, spec: JobSpec) -> None:
        check_trainjob_spec(spec)

    def state(self, job: Dict[str, Any]) -> JobState:
        status = job.get("status") or {}
        conditions = list(status.get("conditions") or [])
        true = {c.get("type") for c in conditions if c.get("status") == "True"}
        phases = [p for c, p in (("Complete", "Succeeded"), ("Failed", "Failed"), ("Suspended", "Suspended"))
                  if c in true]
        node = next((j for j in status.get("jobsStatus") or [] if j.get("name") == NODE), None)
        if node is not None:  # the JobSet exists and reports its Jobs: the launcher's Created / Running
            # "active" counts a Job with a pending pod too; "ready" counts a Job whose pods are all ready
            # or done (jobset v0.12.0 updateReplicatedJobsStatuses), so only that means running.
            active, ready = int(node.get("active") or 0), int(node.get("ready") or 0)
            derived = "Running" if ready > 0 else "Created"
            phases.append(derived)
            conditions.append({"type": derived, "status": "True", "reason": "JobsStatus",
                               "message": f"node Job: active {active}, ready {ready} (status.jobsStatus)"})
        failed = next((c for c in conditions if c.get("type") == "Failed"), {})
        return JobState(phase=highest_phase(phases), suspended=bool((job.get("spec") or {}).get("suspend")),
                        conditions=conditions,
                        failure=f"{failed.get('reason') or 'Failed'}: {failed.get('message', 'the job failed')}")

    def pod_selector(self, job_name: str) -> str:
        return f"{JOBSET_NAME_LABEL}={job_name},{REPLICATED_JOB_LABEL}={NODE}"

    def rank0_pod(self, pods: List[Dict[str, Any]], job_name: str) -> Optional[Dict[str, Any]]:
        def labels(pod):
            return pod.get("metadata", {}).get("labels") or {}

        zero = [p for p in pods if labels(p).get(COMPLETION_INDEX_LABEL) == "0"
                and labels(p).get(JOB_INDEX_LABEL, "0") == "0" and not p["metadata"].get("deletionTimestamp")]
        # After a JobSet restart the old pods may linger: the newest attempt is the live one.
        return max(zero, key=lambda p: int(labels(p).get(RESTART_ATTEMPT_LABEL) or 0), default=None)

    def event_objects(self, job_name: str) -> List[str]:
        # The TrainJob and its JobSet share the name; the Job controller reports refused pods
        # (FailedCreate) on the Job.
        return [job_name, f"{job_name}-{NODE}-0"]

    def node_names(self, job_name: str, nodes: int) -> List[str]:
        return [f"{job_name}-{NODE}-0-{i}" for i in range(nodes)]

    def node_env(self, spec: JobSpec, job_name: str, node_rank: int, master_port: int) -> Dict[str, str]:
        """The trainer env (``DOMINO_JOB_NAME``, GPU defaults, ``--env``), then what the torch plugin adds
        (torch.go ``EnforceMLPolicy``): PET_NNODES, PET_NPROC_PER_NODE (``auto`` becomes the CPU count of
        ``resourcesPerNode``, at least 1, on a node without GPUs), PET_NODE_RANK (the completion index),
        PET_MASTER_ADDR/PORT (``<job>-node-0-0.<job>``:29500 in the cluster), and the Job controller's
        ``JOB_COMPLETION_INDEX`` (indexed_job_utils.go)."""
        nproc = spec.nproc_per_node
        if not isinstance(nproc, int) and spec.gpus_per_node == 0:
            res = resources(spec)
            cpu = res["requests"].get("cpu") or res.get("limits", {}).get("cpu") or "0"
            nproc = max(1, _cpu_ceil(cpu))
        env = {"DOMINO_JOB_NAME": job_name, **{k: str(v) for k, v in defaults.environment(spec).items()}}
        env.update({
            "PET_NNODES": str(spec.nodes),
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(node_rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(master_port),
            "JOB_COMPLETION_INDEX": str(node_rank),
        })
        return env

    def backoff_limit(self, spec: JobSpec) -> int:
        """In the local backend's count (one restart per node per fault), the fault at which the JobSet
        reaches maxRestarts: (maxRestarts + 1) x nodes."""
        return (defaults.JOBSET_MAX_RESTARTS + 1) * spec.nodes
