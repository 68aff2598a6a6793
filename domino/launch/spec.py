"""The typed description of one distributed ``domino pretrain`` job, validated in one place.

A :class:`JobSpec` says what to run (image, ``domino pretrain`` arguments or a command override), on how
many nodes and processes, with which resources and scheduling constraints, and how failures are handled.
The same spec is rendered into a Kubeflow PyTorchJob (:mod:`domino.launch.render`) and executed on this
machine by the local backend (:mod:`domino.launch.local_backend`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from domino.config.flags import flag

#: Where the shared ReadWriteMany volume (data, checkpoints) is mounted in every pod.
DEFAULT_MOUNT_PATH = "/mnt/domino"
#: The Master's rendezvous port (the operator's ``pytorchjob-port``).
MASTER_PORT = 23456
#: The container name the training operator's webhook requires.
CONTAINER_NAME = "pytorch"

RESTART_POLICIES = ("OnFailure", "ExitCode")
CLEAN_POD_POLICIES = ("All", "Running", "None")
TOLERATION_OPERATORS = ("Equal", "Exists")
TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
#: Who chooses the tensor-parallel size: the pretrain arguments, or the launcher from the pods granted
#: (see domino.launch.parallel_layout).
PARALLEL_LAYOUTS = ("given", "derive")

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")  # a Secret's data keys (apimachinery IsConfigMapKey)
#: Names that say a value is a credential. A literal env value is written into the job object (and, from the
#: pipeline, into KFP's stored run parameters) in plain text, so such a value must come from a Secret. The
#: words stand between underscores or the name's ends: HF_TOKEN is one, TOKENIZERS_PARALLELISM is not.
CREDENTIAL_NAME = re.compile(r"(?:^|_)(?:TOKEN|PASSWORD|PASSWD|SECRET|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|"
                             r"CREDENTIALS?)(?:_|$)", re.I)
#: The default of :attr:`JobSpec.start_timeout_s`: a first pull of the multi-GB CUDA image on a fresh node
#: takes minutes (tens of them on a slow registry link), and every node of a job pulls at its own pace.
DEFAULT_START_TIMEOUT_S = 1200


def parse_nproc(text: str) -> Union[int, str]:
    """``--nproc-per-node``: a count (``"4"`` -> 4), or a word torchrun knows (auto, cpu, gpu)."""
    return int(text) if text.isdigit() else text


def _repeated(name: str, metavar: str) -> Dict[str, Any]:
    """The flag of a ``Dict`` or ``List`` field: repeatable, its items as typed (``KEY=VALUE``...)."""
    return flag(name, action="append", default=[], metavar=metavar)


def credential_names(env: Dict[str, str]) -> List[str]:
    """The variables of ``env`` with a value whose name says they hold a credential, sorted."""
    return sorted(name for name, value in env.items() if value and CREDENTIAL_NAME.search(name))


def default_namespace() -> str:
    """The launching pod's namespace (``POD_NAMESPACE``, downward API), else ``domino``.

    A kfp step runs in the namespace its service account may create jobs in (standalone KFP: the
    KFP namespace as ``pipeline-runner``; multi-user KFP: the profile namespace as ``default-editor``),
    so its training job belongs there too, beside the volume the step mounts.
    """
    return os.environ.get("POD_NAMESPACE") or "domino"


class LaunchSpecError(ValueError):
    """A job setting that cannot work; the message names the field (and its flag) and the problem."""


@dataclass
class Toleration:
    """One pod toleration (``key=value:effect`` on the command line; ``key:effect`` means Exists)."""

    key: str
    """Taint key to tolerate."""
    value: str = ""
    """Taint value (empty with operator Exists)."""
    effect: str = ""
    """NoSchedule, PreferNoSchedule, NoExecute, or empty for all effects."""
    operator: str = "Equal"
    """Equal or Exists."""

    @classmethod
    def parse(cls, text: str) -> "Toleration":
        """Parses ``key[=value][:effect]``; without ``=value`` the operator is Exists."""
        body, _, effect = text.partition(":")
        key, eq, value = body.partition("=")
        return cls(key=key, value=value, effect=effect, operator="Equal" if eq else "Exists")

    def to_dict(self) -> Dict[str, str]:
        """The Kubernetes ``Toleration`` object."""
        out = {"key": self.key, "operator": self.operator}
        if self.operator == "Equal":
            out["value"] = self.value
        if self.effect:
            out["effect"] = self.effect
        return out


@dataclass
class JobSpec:
    """Everything needed to run ``domino pretrain`` as one multi-node job.

    Kubernetes quantities (``cpu_request``, ``memory_limit``, ``shm_size``) are strings in Kubernetes
    notation (``"8"``, ``"500m"``, ``"64Gi"``). ``None`` leaves a setting to the cluster's defaults.
    """

    name: str = field(metadata=flag(required=True))
    """Base job name (DNS-1035); the per-run job name appends a run suffix (see domino.launch.naming)."""
    image: str
    """Container image holding the domino package (see the Dockerfile)."""
    pretrain_args: List[str] = field(default_factory=list)
    """Arguments for ``domino pretrain`` (the config flags)."""
    command: Optional[List[str]] = field(default=None, metadata=flag(type=str, nargs=None, metavar="'CMD ARG...'"))
    """Full container command overriding ``torchrun -m domino pretrain ARGS``; used verbatim."""
    namespace: str = field(default_factory=default_namespace, metadata=flag(default=None))
    """Namespace of the job (and of the PVC); default ``$POD_NAMESPACE``, else ``domino``."""
    nodes: int = 1
    """Pods: 1 Master plus nodes-1 Workers."""
    nproc_per_node: Union[int, str] = field(default=1, metadata=flag(type=parse_nproc, metavar="N"))
    """Processes per pod (torchrun's --nproc-per-node): an integer, or auto, cpu, gpu."""
    gpus_per_node: int = 0
    """``nvidia.com/gpu`` requested (and limited) per pod."""
    cpu_request: Optional[str] = None
    """CPU request per pod; default sized from the processes per pod (see domino.launch.defaults)."""
    cpu_limit: Optional[str] = None
    """CPU limit per pod."""
    memory_request: Optional[str] = None
    """Memory request per pod; default sized from the processes per pod (see domino.launch.defaults)."""
    memory_limit: Optional[str] = None
    """Memory limit per pod."""
    shm_size: Optional[str] = "16Gi"
    """Size limit of the memory-backed emptyDir at /dev/shm (NCCL and data-loader workers need more than 64Mi)."""
    pvc: str = "domino-data"
    """Name of the ReadWriteMany PersistentVolumeClaim holding data and checkpoints."""
    mount_path: str = DEFAULT_MOUNT_PATH
    """Where the PVC is mounted in every pod."""
    checkpoint_dir: Optional[str] = None
    """--save/--load directory; default ``<mount_path>/checkpoints/<job name>`` (a restarted pod resumes)."""
    node_selector: Dict[str, str] = field(default_factory=dict, metadata=_repeated("--node-selector", "KEY=VALUE"))
    """Pod node selector."""
    tolerations: List[Toleration] = field(default_factory=list,
                                          metadata=_repeated("--toleration", "KEY[=VALUE][:EFFECT]"))
    """Pod tolerations."""
    gpu_toleration: bool = field(default=True, metadata=flag("--no-gpu-toleration", action="store_false"))
    """GPU pods tolerate the ``nvidia.com/gpu`` taint GPU node pools carry (see domino.launch.defaults);
    ``--no-gpu-toleration`` leaves that toleration out, and a toleration of your own for that key replaces it."""
    priority_class: Optional[str] = None
    """PriorityClass name of the pods."""
    image_pull_secrets: List[str] = field(default_factory=list, metadata=_repeated("--image-pull-secret", "SECRET"))
    """Secrets for pulling the image from a private registry."""
    image_pull_policy: str = field(default="IfNotPresent", metadata=flag(choices=PULL_POLICIES))
    """Always, IfNotPresent or Never."""
    service_account: Optional[str] = None
    """ServiceAccount of the training pods (they need no API access; the token is not mounted)."""
    env: Dict[str, str] = field(default_factory=dict, metadata=_repeated("--env", "KEY=VALUE"))
    """Extra environment variables of the training container (literal values, written into the job: nothing
    secret)."""
    secret_env: Dict[str, str] = field(default_factory=dict, metadata=_repeated("--env-secret", "NAME=SECRET:KEY"))
    """Environment variables read from Secrets when the pod starts (``valueFrom.secretKeyRef``):
    ``NAME -> "SECRET:KEY"`` (required: the pod does not start without it), or ``NAME -> "SECRET"`` (the key
    named like the variable, optional: a missing Secret or key leaves it unset). Credentials go here, never
    into ``env``: the job holds only the reference."""
    env_from_secrets: List[str] = field(default_factory=list, metadata=_repeated("--env-from-secret", "SECRET"))
    """Secrets whose every key becomes an environment variable of the training container (``envFrom``)."""
    labels: Dict[str, str] = field(default_factory=dict, metadata=_repeated("--label", "KEY=VALUE"))
    """Extra labels on the job and its pods."""
    annotations: Dict[str, str] = field(default_factory=dict, metadata=_repeated("--annotation", "KEY=VALUE"))
    """Extra annotations on the job and its pods."""
    owner: Optional[str] = None
    """Who launched the job (the ``domino/owner`` label); default: $USER or ``domino``."""
    restart_policy: str = field(default="OnFailure", metadata=flag(choices=RESTART_POLICIES))
    """OnFailure (restart any failed pod, counted against backoff_limit) or ExitCode (retry exit codes
    128-255 without counting them; 1-127 are permanent). See docs/cluster.md, "Restarts"."""
    backoff_limit: Optional[int] = None
    """Container restarts, summed over all pods, at which the job is Failed; default 3 x nodes (one
    fault restarts every pod of the job, so the job survives two faults and fails at the third)."""
    active_deadline_seconds: Optional[int] = None
    """Cluster-side time limit of the job."""
    ttl_seconds_after_finished: Optional[int] = 86400
    """The operator deletes the finished job after this many seconds."""
    clean_pod_policy: str = field(default="Running", metadata=flag(choices=CLEAN_POD_POLICIES))
    """Pods deleted when the job finishes: All, Running (still-running ones) or None."""
    start_timeout_s: int = field(default=DEFAULT_START_TIMEOUT_S, metadata=flag("--start-timeout", metavar="SECONDS"))
    """Seconds the nodes wait for each other when the job (re)starts: torchrun's rendezvous timeout
    (``PET_RDZV_CONF=timeout=N``, the static rendezvous's TCPStore wait), at least a cold pull of the image
    on a fresh node. The Workers' init container waits as long cluster-wide (k8s/operator)."""
    termination_grace_period_s: int = field(default=180, metadata=flag("--termination-grace-period", metavar="SECONDS"))
    """Seconds between SIGTERM and SIGKILL for a deleted or evicted pod: ``--exit-signal-handler``
    finishes the iteration and saves a checkpoint in this time."""
    queue: Optional[str] = field(default=None, metadata=flag(metavar="LOCALQUEUE"))
    """Kueue LocalQueue: the job gets the ``kueue.x-k8s.io/queue-name`` label; Kueue's webhook suspends
    it at creation and Kueue resumes it once admitted."""
    scheduling_policy: bool = field(default=False, metadata=flag(action="store_true"))
    """Fill ``runPolicy.schedulingPolicy`` (minAvailable = all pods, queue, priorityClass) for gang
    scheduling by volcano or scheduler-plugins (the operator's ``--gang-scheduler-name``)."""
    rdma_resources: Dict[str, str] = field(default_factory=dict,
                                           metadata=_repeated("--rdma-resource", "RESOURCE=COUNT"))
    """The fast network (docs/cluster.md, "Fast network"): extended resources of an RDMA device plugin per
    pod (e.g. ``rdma/rdma_shared_device_a: "1"``); the container also gets the ``IPC_LOCK`` capability RDMA
    memory registration needs, which Pod Security "restricted" and "baseline" both refuse."""
    gpu_memory_gb: Optional[float] = None
    """Memory of one GPU in GiB: refuse, before creating anything, a layout whose memory estimate
    (``domino estimate``) does not fit; None: no check."""
    parallel_layout: str = field(default="given", metadata=flag(choices=PARALLEL_LAYOUTS))
    """Who picks the layout: ``given`` (the pretrain arguments' ``--tensor-model-parallel-size``, DP the rest)
    or ``derive`` (the launcher picks the smallest tensor-parallel size within one pod that the model admits
    and, with ``gpu_memory_gb``, fits; DP across the pods; a given ``--tensor-model-parallel-size`` is the
    largest allowed; a larger ``--context-parallel-size`` where only the sequence's memory does not fit). The
    checkpoint is layout-free, so a run resubmitted on other pods with ``derive``
    continues on the layout those pods hold (docs/cluster.md, "Preemption and another layout")."""
    run_as_user: int = 1000
    """Non-root UID of the training container (the image works under any UID, see the Dockerfile)."""

    def validate(self) -> None:
        """Raises :class:`LaunchSpecError` listing every problem, each naming its field and flag."""
        problems: List[str] = []

        def check(ok: bool, flag: str, message: str) -> None:
            if not ok:
                problems.append(f"{flag}: {message}")

        check(bool(_DNS1035_LABEL.match(self.name or "")), "--name",
              f"{self.name!r} must be a DNS-1035 label (lowercase letters, digits, '-', starting with a letter)")
        check(len(self.name or "") <= 40, "--name", f"{self.name!r} is longer than 40 characters "
              "(the run suffix and the operator's -worker-N pod suffix must still fit in 63)")
        check(bool(self.image and not any(c.isspace() for c in self.image)), "--image",
              f"{self.image!r} is not an image reference")
        check(bool(_DNS1123_LABEL.match(self.namespace or "")) and len(self.namespace) <= 63, "--namespace",
              f"{self.namespace!r} is not a valid namespace name")
        check(isinstance(self.nodes, int) and self.nodes >= 1, "--nodes", f"must be >= 1, got {self.nodes}")
        nproc = self.nproc_per_node
        check((isinstance(nproc, int) and nproc >= 1) or nproc in ("auto", "cpu", "gpu"), "--nproc-per-node",
              f"must be a positive integer or auto/cpu/gpu, got {nproc!r}")
        check(isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 0, "--gpus-per-node",
              f"must be >= 0, got {self.gpus_per_node}")
        check(self.gpu_memory_gb is None or self.gpu_memory_gb > 0, "--gpu-memory-gb",
              f"must be > 0, got {self.gpu_memory_gb}")
        if isinstance(nproc, int) and self.gpus_per_node > 0:
            check(nproc <= self.gpus_per_node, "--nproc-per-node",
                  f"{nproc} processes per node but only {self.gpus_per_node} GPUs per node")
        for attr in ("cpu_request", "cpu_limit", "memory_request", "memory_limit", "shm_size"):
            value = getattr(self, attr)
            check(value is None or bool(_QUANTITY.match(str(value))), "--" + attr.replace("_", "-"),
                  f"{value!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)")
        check(bool(_DNS1123_SUBDOMAIN.match(self.pvc or "")), "--pvc", f"{self.pvc!r} is not a valid claim name")
        check(self.mount_path.startswith("/") and self.mount_path not in ("/", "/dev/shm"), "--mount-path",
              f"{self.mount_path!r} must be an absolute path other than / and /dev/shm")
        check(self.restart_policy in RESTART_POLICIES, "--restart-policy",
              f"{self.restart_policy!r} is not one of {', '.join(RESTART_POLICIES)}")
        check(self.parallel_layout in PARALLEL_LAYOUTS, "--parallel-layout",
              f"{self.parallel_layout!r} is not one of {', '.join(PARALLEL_LAYOUTS)}")
        check(self.clean_pod_policy in CLEAN_POD_POLICIES, "--clean-pod-policy",
              f"{self.clean_pod_policy!r} is not one of {', '.join(CLEAN_POD_POLICIES)}")
        check(self.image_pull_policy in PULL_POLICIES, "--image-pull-policy",
              f"{self.image_pull_policy!r} is not one of {', '.join(PULL_POLICIES)}")
        for attr in ("backoff_limit", "active_deadline_seconds", "ttl_seconds_after_finished"):
            value = getattr(self, attr)
            minimum = 1 if attr == "active_deadline_seconds" else 0
            check(value is None or (isinstance(value, int) and value >= minimum), "--" + attr.replace("_", "-"),
                  f"must be an integer >= {minimum}, got {value!r}")
        check(isinstance(self.termination_grace_period_s, int) and self.termination_grace_period_s >= 0,
              "--termination-grace-period", f"must be an integer >= 0, got {self.termination_grace_period_s!r}")
        check(self.queue is None or (bool(_DNS1123_SUBDOMAIN.match(self.queue)) and len(self.queue) <= 63),
              "--queue", f"{self.queue!r} is not a valid LocalQueue name")
        check(isinstance(self.run_as_user, int) and self.run_as_user > 0, "run_as_user",
              f"must be a non-root UID (> 0), got {self.run_as_user!r}")
        for attr in ("priority_class", "service_account"):
            value = getattr(self, attr)
            check(value is None or bool(_DNS1123_SUBDOMAIN.match(value)), "--" + attr.replace("_", "-"),
                  f"{value!r} is not a valid object name")
        for secret in self.image_pull_secrets:
            check(bool(_DNS1123_SUBDOMAIN.match(secret)), "--image-pull-secret", f"{secret!r} is not a valid name")
        for key in self.env:
            check(bool(_ENV_NAME.match(key)), "--env", f"{key!r} is not a valid environment variable name")
        for key in credential_names(self.env):
            check(False, "--env", f"{key} looks like a credential, and a literal value is stored in the job in "
                  f"plain text: put it in a Secret and use --env-secret {key}=SECRET:KEY")
        check(isinstance(self.start_timeout_s, int) and self.start_timeout_s >= 1, "--start-timeout",
              f"must be an integer >= 1 (seconds), got {self.start_timeout_s!r}")
        for key, ref in self.secret_env.items():
            check(bool(_ENV_NAME.match(key)), "--env-secret", f"{key!r} is not a valid environment variable name")
            check(key not in self.env, "--env-secret", f"{key} is also given a literal value by --env")
            secret, colon, secret_key = ref.partition(":")
            check(bool(_DNS1123_SUBDOMAIN.match(secret)) and (not colon or bool(_SECRET_KEY.match(secret_key))),
                  "--env-secret", f"{key}={ref!r}: expected SECRET:KEY or SECRET (a Secret's name, one of its keys)")
        for secret in self.env_from_secrets:
            check(bool(_DNS1123_SUBDOMAIN.match(secret)), "--env-from-secret", f"{secret!r} is not a valid Secret name")
        for attr, flag in (("labels", "--label"), ("node_selector", "--node-selector")):
            for key, value in getattr(self, attr).items():
                check(_valid_label_key(key), flag, f"{key!r} is not a valid label key")
                check(len(value) <= 63 and bool(_LABEL_VALUE.match(value)), flag,
                      f"{value!r} (for {key!r}) is not a valid label value")
        for key, value in self.rdma_resources.items():
            check("/" in key and _valid_label_key(key), "--rdma-resource",
                  f"{key!r} is not an extended resource name (domain/name, e.g. rdma/rdma_shared_device_a)")
            check(str(value).isdigit() and int(value) > 0, "--rdma-resource", f"{key}={value!r}: the count must "
                  "be a positive integer")
        for key in self.annotations:
            check(_valid_label_key(key), "--annotation", f"{key!r} is not a valid annotation key")
        for tol in self.tolerations:
            check(tol.operator in TOLERATION_OPERATORS, "--toleration", f"operator {tol.operator!r} is invalid")
            check(tol.effect in TOLERATION_EFFECTS, "--toleration", f"effect {tol.effect!r} is invalid")
            check(tol.operator == "Equal" or not tol.value, "--toleration",
                  f"{tol.key!r}: operator Exists takes no value")
            check(not tol.key or _valid_label_key(tol.key), "--toleration", f"{tol.key!r} is not a valid taint key")
        check(self.command is None or (len(self.command) > 0 and all(isinstance(a, str) for a in self.command)),
              "--command", "must be a non-empty list of strings")
        check(all(isinstance(a, str) for a in self.pretrain_args), "pretrain_args", "must be strings")
        if problems:
            raise LaunchSpecError("invalid job spec: " + "; ".join(problems))

    @property
    def world_size(self) -> Optional[int]:
        """Processes in the whole job, when ``nproc_per_node`` is an integer."""
        return self.nodes * self.nproc_per_node if isinstance(self.nproc_per_node, int) else None


def _valid_label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.match(name))


def parse_key_values(items: List[str], flag: str) -> Dict[str, str]:
    """``["a=1", "b=2"]`` -> ``{"a": "1", "b": "2"}``; raises :class:`LaunchSpecError` naming ``flag``."""
    out: Dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise LaunchSpecError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out
