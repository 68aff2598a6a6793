"""Renders a :class:`~domino.launch.spec.JobSpec` as a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1).

A TrainJob carries only what varies per job; the pod shape lives in the TrainingRuntime that ``k8s/trainer``
ships (:data:`RUNTIME_NAME`: the domino image, the shared volume at :data:`RUNTIME_PVC`, /dev/shm, the
restricted security context). What goes where, per the v2.3.0 CRD (``../shared/schemas/trainer-v2.3.0``):

* ``spec.trainer``: numNodes, numProcPerNode, resourcesPerNode (GPUs included), image, command, env;
* ``spec.runtimePatches`` (one entry owned by :data:`PATCH_MANAGER`): the pod fields a patch may set
  and the runtime leaves unset: labels/annotations, nodeSelector, tolerations, imagePullSecrets,
  serviceAccountName, terminationGracePeriodSeconds;
* ``spec.suspend`` + the Kueue queue label with ``--queue``; ``spec.activeDeadlineSeconds``.

The container runs the same ``torchrun -m domino pretrain ...`` as the PyTorchJob: torchrun reads the
``PET_*`` variables (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT)
that the Trainer's torch plugin injects into the ``node`` container (kubeflow/trainer
``pkg/runtime/framework/plugins/torch/torch.go``, ``EnforceMLPolicy``), which is also why ``--env`` may
not set them (the plugin's ``Validate`` rejects reserved names).

Settings the TrainJob API has no field for are refused with the flag's name rather than dropped
silently (see :func:`check_trainjob_spec`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from domino.launch import defaults, naming
from domino.launch.render import ISTIO_INJECT, container_command, job_metadata, pod_placement, resources
from domino.launch.spec import DEFAULT_MOUNT_PATH, JobSpec, LaunchSpecError

API_VERSION = "trainer.kubeflow.org/v1alpha1"
KIND = "TrainJob"
GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
#: The namespaced TrainingRuntime shipped in ``k8s/trainer`` (same namespace as the job and the PVC).
RUNTIME_NAME = "domino-torch-distributed"
RUNTIME_KIND = "TrainingRuntime"
#: The claim, mount path and /dev/shm size baked into that runtime's pod template.
RUNTIME_PVC, RUNTIME_MOUNT_PATH, RUNTIME_SHM_SIZE = "domino-data", DEFAULT_MOUNT_PATH, "16Gi"
#: The replicated job and container the torch plugin configures (``constants.Node`` upstream).
NODE = "node"
#: ``manager`` of our runtime patch (the list is keyed by manager; Kueue uses ``kueue.x-k8s.io/manager``).
PATCH_MANAGER = "domino.launch/renderer"
#: Environment the torch plugin owns: ``TorchRunReservedEnvNames`` (kubeflow/trainer ``pkg/constants/constants.go``),
#: which torch.go ``Validate`` refuses in ``trainer.env``.
RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def check_trainjob_spec(spec: JobSpec) -> None:
    """Raises :class:`LaunchSpecError` for settings a v2.3.0 TrainJob cannot carry.

    The runtime patches of v2.3.0 cannot set ``priorityClassName``; restarts and pod cleanup are the
    runtime's JobSet policies, not per-job fields; and volumes stay the runtime's, so the claim, mount
    path and /dev/shm size must be the ones it mounts.
    """
    problems: List[str] = []

    def refuse(bad: bool, flag: str, why: str) -> None:
        if bad:
            problems.append(f"{flag}: {why}")

    refuse(isinstance(spec.nproc_per_node, str) and spec.nproc_per_node != "auto", "--nproc-per-node",
           f"{spec.nproc_per_node!r}: a TrainJob takes an integer or auto (numProcPerNode is int32 in v2.3.0)")
    refuse(spec.pvc != RUNTIME_PVC, "--pvc", f"the TrainJob API mounts the runtime's claim {RUNTIME_PVC!r}")
    refuse(spec.mount_path != RUNTIME_MOUNT_PATH, "--mount-path", f"the runtime mounts the claim at {RUNTIME_MOUNT_PATH}")
    refuse(spec.shm_size != RUNTIME_SHM_SIZE, "--shm-size", f"the runtime's /dev/shm is {RUNTIME_SHM_SIZE}")
    refuse(spec.priority_class is not None, "--priority-class", "runtime patches cannot set priorityClassName")
    refuse(spec.restart_policy != "OnFailure", "--restart-policy", "restarts follow the runtime's JobSet policy")
    refuse(spec.backoff_limit is not None, "--backoff-limit", "restarts follow the runtime's JobSet policy")
    refuse(spec.clean_pod_policy != "Running", "--clean-pod-policy", "a TrainJob has no pod cleanup policy")
    refuse(spec.scheduling_policy, "--scheduling-policy", "use the runtime's podGroupPolicy for gang scheduling")
    reserved = sorted(set(spec.env) & set(RESERVED_ENV))
    refuse(bool(reserved), "--env", f"{', '.join(reserved)} are set by the Trainer's torch plugin")
    if problems:
        raise LaunchSpecError("invalid job spec for --api trainjob: " + "; ".join(problems))


def _pod_patch(spec: JobSpec, labels: Dict[str, str]) -> Dict[str, Any]:
    """The pod template patch for the ``node`` replicated job: only fields the runtime leaves unset."""
    pod = {"terminationGracePeriodSeconds": spec.termination_grace_period_s, **pod_placement(spec)}
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
        "command": container_command(spec, name),
        "numNodes": spec.nodes,
        "resourcesPerNode": resources(spec),
        "env": [{"name": k, "value": str(v)} for k, v in env.items()],
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
    if spec.queue:
        # As for the PyTorchJob: created suspended (the CRD's spec.suspend), the job waits in its Kueue
        # queue until admitted and resumed.
        job_spec["suspend"] = True
    metadata = job_metadata(spec, name, run_id, labels, owner_reference)
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": job_spec}
