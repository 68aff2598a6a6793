"""Renders a :class:`~domino.launch.spec.JobSpec` as a Kubeflow PyTorchJob (kubeflow.org/v1).

The job has one Master and ``nodes - 1`` Workers sharing one pod template. The container named
``pytorch`` runs ``torchrun -m domino pretrain ...``; torchrun reads the ``PET_*`` variables the
training operator injects (nodes, node rank, master address), so the command carries no rendezvous
flags. ``--save`` and ``--load`` point at the same directory on the shared volume (``--load`` follows a
given ``--save``), so a restarted pod (or a retried run that adopts its job) resumes from the latest checkpoint. Settings the spec leaves
unset (requests, backoffLimit, GPU environment) come from :mod:`domino.launch.defaults`.

The pods pass the Pod Security "restricted" profile (tests/k8s/pod_security.py checks every container
of every pod the operator creates, including its ``init-pytorch`` init container as configured by
``k8s/operator``), run with a read-only root filesystem (writable emptyDirs at /tmp, $HOME and
/dev/shm), and opt out of Istio sidecar injection: a sidecar keeps a finished pod Running and
intercepts the rendezvous and NCCL traffic.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import yaml

from domino.launch import defaults, naming
from domino.launch.parallel_layout import layout_flags
from domino.launch.pretrain_flags import flag_value, has_flag
from domino.launch.spec import CONTAINER_NAME, MASTER_PORT, JobSpec

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
#: The label Kueue reads the LocalQueue from (kubernetes-sigs/kueue, ``pkg/controller/constants``).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Istio's per-pod opt-out of sidecar injection (label and annotation are both honoured).
ISTIO_INJECT = "sidecar.istio.io/inject"
#: The image's $HOME (Dockerfile): an emptyDir, since the root filesystem is read-only.
HOME_DIR = "/home/domino"
#: The module that runs the training command as the container's first process.
RELAY_MODULE = "domino.launch.signal_relay"


def checkpoint_dir(spec: JobSpec, name: str) -> str:
    """The --save/--load directory of job ``name`` on the shared volume."""
    return spec.checkpoint_dir or f"{spec.mount_path.rstrip('/')}/checkpoints/{name}"


def metrics_port(spec: JobSpec) -> Optional[int]:
    """The ``--metrics-port`` of the pretrain arguments (rank 0's Prometheus endpoint), if any and not 0."""
    value = flag_value(list(spec.pretrain_args), "--metrics-port")
    return int(value) if value is not None and value.isdigit() and int(value) > 0 else None


def container_command(spec: JobSpec, name: str) -> List[str]:
    """The training container's command: the override verbatim, else the signal relay (:func:`relay_prefix`) running
    torchrun + pretrain + resume flags (``--exit-signal-handler`` unless the arguments say otherwise,
    ``--save``/``--load``, and with ``--parallel-layout derive`` the tensor-parallel size derived for the job's pods).

    A restart must resume the run's own checkpoint: without ``--save`` the job saves into its folder on the
    volume; without ``--load`` it loads from where it saves (``-- --save X`` gets ``--load X``, not an
    empty folder). With ``--load OTHER``, ``domino pretrain`` resumes ``--save``'s checkpoint once one
    exists (:func:`domino.checkpoint.resume.find_checkpoint`), so a restart never reloads OTHER."""
    if spec.command is not None:
        return list(spec.command)
    args = [*spec.pretrain_args, *layout_flags(spec)]
    save = flag_value(args, "--save")
    if save is None:
        save = checkpoint_dir(spec, name)
        args += ["--save", save]
    if not has_flag(args, "--load"):
        args += ["--load", save]
    # A pod being evicted gets SIGTERM: save where training stands before the grace period ends.
    if not has_flag(args, "--exit-signal-handler") and not has_flag(args, "--no-exit-signal-handler"):
        args.append("--exit-signal-handler")
    return [*relay_prefix(spec), "torchrun", "-m", "domino", "pretrain", *args]


def relay_prefix(spec: JobSpec) -> List[str]:
    """What the training command starts with: the signal relay as the container's first process, so a SIGTERM
    reaches the ranks with the whole grace period on every torch (:mod:`domino.launch.signal_relay`)."""
    return ["python", "-m", RELAY_MODULE, "--grace-period-s", str(spec.termination_grace_period_s)]


def escape_expansion(arg: str) -> str:
    """``arg`` as a container command element that Kubernetes passes verbatim: every ``$`` doubled.

    The kubelet expands ``$(VAR)`` in a container's command and args from the container's environment
    and reduces ``$$`` to ``$`` (core/v1 ``Container.command``: "Double $$ are reduced to a single $, which
    allows for escaping the $(VAR_NAME) syntax"; kubernetes/kubernetes
    ``third_party/forked/golang/expansion/expand.go`` ``Expand``). So an argument ``$(HF_TOKEN)`` would
    reach torchrun as the token's value; doubled, every ``$`` reaches it as written."""
    return arg.replace("$", "$$")


def kube_command(spec: JobSpec, name: str) -> List[str]:
    """:func:`container_command` as the job's pods carry it (:func:`escape_expansion` on every element); the
    local backend runs :func:`container_command` itself, as the kubelet's expansion leaves it."""
    return [escape_expansion(arg) for arg in container_command(spec, name)]


def resources(spec: JobSpec) -> Dict[str, Dict[str, str]]:
    """Requests and limits of one pod (one TrainJob node): CPU/memory, and GPUs with request == limit."""
    requests = defaults.requests(spec)
    limits = {key: str(value) for key, value in (("cpu", spec.cpu_limit), ("memory", spec.memory_limit))
              if value is not None}
    if spec.gpus_per_node:
        # Extended resources must have request == limit.
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(spec.gpus_per_node)
    for name, count in sorted(spec.rdma_resources.items()):
        requests[name] = limits[name] = str(count)
    out = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def pod_placement(spec: JobSpec) -> Dict[str, Any]:
    """The pod fields set only when asked (or, for the GPU toleration, by default on GPU pods): node selector,
    tolerations, pull secrets, service account."""
    out: Dict[str, Any] = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    tolerations = defaults.tolerations(spec)
    if tolerations:
        out["tolerations"] = [t.to_dict() for t in tolerations]
    if spec.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if spec.service_account:
        out["serviceAccountName"] = spec.service_account
    return out


def container_security(spec: JobSpec) -> Dict[str, Any]:
    """The training container's securityContext: restricted, or with ``IPC_LOCK`` on the fast network
    (RDMA registers pinned memory, which needs it; all else still dropped)."""
    capabilities: Dict[str, Any] = {"drop": ["ALL"]}
    if spec.rdma_resources:
        capabilities["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": capabilities,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": spec.run_as_user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_template(spec: JobSpec, name: str, labels: Dict[str, str]) -> Dict[str, Any]:
    """The pod template shared by Master and Workers (PSS restricted, shared volume, /dev/shm)."""
    env = [{"name": "DOMINO_JOB_NAME", "value": name}]
    env += [{"name": k, "value": str(v)} for k, v in defaults.environment(spec).items()]
    env += defaults.secret_environment(spec)
    port = metrics_port(spec)  # rank 0's Prometheus endpoint, declared so a PodMonitor can name it
    container: Dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": kube_command(spec, name),
        "env": env,
        **({"envFrom": [{"secretRef": {"name": s}} for s in spec.env_from_secrets]} if spec.env_from_secrets else {}),
        "ports": [{"name": "pytorchjob-port", "containerPort": MASTER_PORT, "protocol": "TCP"}] + (
            [{"name": "metrics", "containerPort": port, "protocol": "TCP"}] if port else []),
        "resources": resources(spec),
        "volumeMounts": [
            {"name": "domino-data", "mountPath": spec.mount_path},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "home", "mountPath": HOME_DIR},
        ],
        "securityContext": container_security(spec),
    }
    shm: Dict[str, Any] = {"medium": "Memory"}
    if spec.shm_size:
        shm["sizeLimit"] = spec.shm_size
    pod_spec: Dict[str, Any] = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": spec.termination_grace_period_s,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": spec.run_as_user,
            "runAsGroup": spec.run_as_user,
            "fsGroup": spec.run_as_user,
            # The kubelet chowns a volume to fsGroup recursively at every pod start (2 Ti of checkpoints
            # through a CSI driver with fsGroupPolicy File) unless its root already matches.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "domino-data", "persistentVolumeClaim": {"claimName": spec.pvc}},
            {"name": "dshm", "emptyDir": shm},
            {"name": "tmp", "emptyDir": {}},
            {"name": "home", "emptyDir": {}},
        ],
    }
    pod_spec.update(pod_placement(spec))
    if spec.priority_class:
        pod_spec["priorityClassName"] = spec.priority_class
    metadata: Dict[str, Any] = {"labels": {ISTIO_INJECT: "false", **labels},
                                "annotations": {ISTIO_INJECT: "false", **spec.annotations}}
    return {"metadata": metadata, "spec": pod_spec}


def job_metadata(spec: JobSpec, name: str, run_id: str, labels: Dict[str, str],
                 owner_reference: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The job object's metadata (any job API): the run's labels, plus the Kueue queue label with
    ``--queue``; the run-id annotation that adoption checks; the owner reference, if any.

    A queued job is *not* created suspended: Kueue's mutating webhook suspends a job carrying the label
    when its integration is on (kueue v0.19.2 ``jobframework/base_webhook.go``), and resumes it on
    admission (``kubeflowjob`` ``RunWithPodSetsInfo``, ``trainjob`` likewise). Created suspended where
    the integration is off, the job would wait forever; the launcher instead fails it (``NotQueued``)."""
    job_labels = dict(labels)
    if spec.queue:
        job_labels[KUEUE_QUEUE_LABEL] = spec.queue
    metadata: Dict[str, Any] = {
        "name": name,
        "namespace": spec.namespace,
        "labels": job_labels,
        "annotations": {**spec.annotations, naming.RUN_ID_ANNOTATION: run_id},
    }
    if owner_reference:
        metadata["ownerReferences"] = [owner_reference]
    return metadata


def render_job(spec: JobSpec, run_id: str, owner_reference: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The PyTorchJob object for ``spec`` in run ``run_id`` (validated first).

    Args:
        spec: the job description.
        run_id: identifies the run; determines the job name and the ``domino/run-id`` label.
        owner_reference: an ``ownerReferences`` entry (the launching pod), if any.

    Raises:
        LaunchSpecError: when ``spec`` is invalid.
    """
    spec.validate()
    name = naming.job_name(spec.name, run_id, spec.nodes)
    labels = {**spec.labels, **naming.run_labels(run_id, spec.owner, name)}
    template = pod_template(spec, name, labels)
    replica = {"replicas": 1, "restartPolicy": spec.restart_policy, "template": template}
    replicas = {"Master": replica}
    if spec.nodes > 1:
        replicas["Worker"] = {**copy.deepcopy(replica), "replicas": spec.nodes - 1}
    run_policy: Dict[str, Any] = {"cleanPodPolicy": spec.clean_pod_policy, "backoffLimit": defaults.backoff_limit(spec)}
    for key, value in (("activeDeadlineSeconds", spec.active_deadline_seconds),
                       ("ttlSecondsAfterFinished", spec.ttl_seconds_after_finished)):
        if value is not None:
            run_policy[key] = value
    if spec.scheduling_policy:
        # Gang scheduling: volcano / scheduler-plugins start no pod until all of them fit.
        policy: Dict[str, Any] = {"minAvailable": spec.nodes}
        if spec.queue:
            policy["queue"] = spec.queue
        if spec.priority_class:
            policy["priorityClass"] = spec.priority_class
        run_policy["schedulingPolicy"] = policy
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": job_metadata(spec, name, run_id, labels, owner_reference),
        "spec": {
            "nprocPerNode": str(spec.nproc_per_node),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": replicas,
        },
    }


def to_yaml(job: Dict[str, Any]) -> str:
    """The job as a YAML document (keys in rendering order)."""
    return yaml.safe_dump(job, sort_keys=False, default_flow_style=False)
