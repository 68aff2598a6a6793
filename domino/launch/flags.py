"""Command-line flags for a :class:`~domino.launch.spec.JobSpec` (shared by ``render`` and ``submit``)."""

from __future__ import annotations

import argparse
import shlex
from typing import List, Optional

from domino import images
from domino.launch.spec import (
    CLEAN_POD_POLICIES,
    DEFAULT_MOUNT_PATH,
    DEFAULT_START_TIMEOUT_S,
    PARALLEL_LAYOUTS,
    PULL_POLICIES,
    RESTART_POLICIES,
    JobSpec,
    LaunchSpecError,
    Toleration,
    default_namespace,
    parse_key_values,
)


def _nproc(text: str):
    return int(text) if text.isdigit() else text


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per :class:`JobSpec` field; ``-- ARGS`` after them are the ``domino pretrain`` flags."""
    job = parser.add_argument_group("job")
    job.add_argument("--name", required=True, help="Base job name (DNS-1035, <= 40 chars); a run suffix is added.")
    job.add_argument("--image", default=None,
                     help="Container image with the domino package (default: the domino image of this version, "
                          "CUDA with --gpus-per-node, else CPU, in $DOMINO_IMAGE_REPOSITORY; domino/images.py).")
    job.add_argument("--namespace", default=None,
                     help="Namespace of the job and the PVC (default: $POD_NAMESPACE, else domino).")
    job.add_argument("--run-id", default=None,
                     help="Run identifier (default: random); the same id yields the same job name, so a retry "
                          "adopts its own job.")
    job.add_argument("--owner", default=None, help="Value of the domino/owner label (default: $DOMINO_OWNER/$USER).")
    job.add_argument("--command", default=None, metavar="'CMD ARG...'",
                     help="Container command (one shell-quoted string) replacing 'torchrun -m domino pretrain ARGS'.")
    res = parser.add_argument_group("resources")
    res.add_argument("--nodes", type=int, default=1, help="Pods: 1 Master + NODES-1 Workers (default: 1).")
    res.add_argument("--nproc-per-node", type=_nproc, default=1, help="Processes per pod: N, auto, cpu or gpu.")
    res.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per pod (default: 0).")
    for what in ("cpu", "memory"):
        for kind in ("request", "limit"):
            res.add_argument(f"--{what}-{kind}", default=None, help=f"{what.upper()} {kind} per pod (quantity)" + (
                "; default sized from --nproc-per-node." if kind == "request" else "."))
    res.add_argument("--gpu-memory-gb", type=float, default=None,
                     help="Memory of one GPU in GiB: refuse a layout whose estimate (domino estimate) does not fit "
                          "(default: no check).")
    res.add_argument("--parallel-layout", default="given", choices=PARALLEL_LAYOUTS,
                     help="given: the pretrain arguments' --tensor-model-parallel-size; derive: the smallest TP "
                          "within one pod that the model admits and (with --gpu-memory-gb) fits, DP across pods, "
                          "for a run resubmitted on other pods (default: given).")
    res.add_argument("--shm-size", default="16Gi", help="Size limit of /dev/shm (memory emptyDir; default 16Gi).")
    storage = parser.add_argument_group("storage")
    storage.add_argument("--pvc", default="domino-data", help="RWX PersistentVolumeClaim for data and checkpoints.")
    storage.add_argument("--mount-path", default=DEFAULT_MOUNT_PATH, help="Where the PVC is mounted.")
    storage.add_argument("--checkpoint-dir", default=None,
                         help="--save/--load directory (default: MOUNT_PATH/checkpoints/JOB_NAME).")
    sched = parser.add_argument_group("scheduling")
    sched.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                       help="Pod node selector entry (repeatable).")
    sched.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]",
                       help="Pod toleration (repeatable); without =VALUE the operator is Exists.")
    res.add_argument("--rdma-resource", action="append", default=[], metavar="RESOURCE=COUNT",
                     help="Fast network: an RDMA device plugin's resource per pod (e.g. rdma/rdma_shared_device_a=1; "
                          "repeatable); adds IPC_LOCK, so the namespace must allow it (k8s/overlays/gpu-fast-network).")
    sched.add_argument("--no-gpu-toleration", dest="gpu_toleration", action="store_false",
                       help="Do not add the default nvidia.com/gpu:NoSchedule toleration to GPU pods.")
    sched.add_argument("--priority-class", default=None, help="PriorityClass of the training pods.")
    sched.add_argument("--image-pull-secret", action="append", default=[], metavar="SECRET",
                       help="Secret for a private registry (repeatable).")
    sched.add_argument("--image-pull-policy", default="IfNotPresent", choices=PULL_POLICIES,
                       help="(default: IfNotPresent)")
    sched.add_argument("--service-account", default=None, help="ServiceAccount of the training pods.")
    sched.add_argument("--queue", default=None, metavar="LOCALQUEUE",
                       help="Kueue LocalQueue: label the job kueue.x-k8s.io/queue-name (Kueue suspends it until "
                            "admitted).")
    sched.add_argument("--scheduling-policy", action="store_true",
                       help="Fill runPolicy.schedulingPolicy (minAvailable = all pods) for volcano/scheduler-plugins.")
    meta = parser.add_argument_group("metadata")
    meta.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                      help="Extra container env (repeatable); a literal value, visible in the job: nothing secret "
                           "(names like *_TOKEN are refused: use --env-secret).")
    meta.add_argument("--env-secret", action="append", default=[], metavar="NAME=SECRET:KEY",
                      help="Container env NAME read from key KEY of Secret SECRET when the pod starts "
                           "(valueFrom.secretKeyRef; repeatable).")
    meta.add_argument("--env-from-secret", action="append", default=[], metavar="SECRET",
                      help="Every key of Secret SECRET as container env (envFrom; PyTorchJob only; repeatable).")
    meta.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                      help="Extra label on the job and its pods (repeatable).")
    meta.add_argument("--annotation", action="append", default=[], metavar="KEY=VALUE",
                      help="Extra annotation on the job and its pods (repeatable).")
    policy = parser.add_argument_group("failure policy")
    policy.add_argument("--restart-policy", default="OnFailure", choices=RESTART_POLICIES,
                        help="OnFailure: restart failed pods; ExitCode: only exit codes 128-255 (default: OnFailure).")
    policy.add_argument("--backoff-limit", type=int, default=None,
                        help="Container restarts summed over all pods before the job fails (default: 3 x nodes).")
    policy.add_argument("--termination-grace-period", type=int, default=180, metavar="SECONDS",
                        help="SIGTERM-to-SIGKILL time of a deleted pod; room to save a checkpoint (default: 180).")
    policy.add_argument("--start-timeout", type=int, default=DEFAULT_START_TIMEOUT_S, metavar="SECONDS",
                        help="How long the nodes wait for each other at a (re)start: torchrun's rendezvous "
                             f"timeout; at least a cold image pull (default: {DEFAULT_START_TIMEOUT_S}).")
    policy.add_argument("--active-deadline-seconds", type=int, default=None, help="Cluster-side time limit.")
    policy.add_argument("--ttl-seconds-after-finished", type=int, default=86400,
                        help="The operator deletes the finished job after this (default: 86400).")
    policy.add_argument("--clean-pod-policy", default="Running", choices=CLEAN_POD_POLICIES,
                        help="Pods deleted when the job ends (default: Running).")
    parser.add_argument("pretrain_args", nargs=argparse.REMAINDER,
                        help="'--' then the domino pretrain flags, e.g. -- --preset tiny --train-iters 100")


def spec_from_args(args: argparse.Namespace, pretrain_args: Optional[List[str]] = None) -> JobSpec:
    """Builds (and validates) the :class:`JobSpec` from parsed flags."""
    extra = list(pretrain_args if pretrain_args is not None else (args.pretrain_args or []))
    if extra and extra[0] == "--":
        extra = extra[1:]
    tolerations = []
    for text in args.toleration:
        tolerations.append(Toleration.parse(text))
    spec = JobSpec(
        name=args.name, image=args.image or images.for_gpus(args.gpus_per_node), pretrain_args=extra,
        command=shlex.split(args.command) if args.command else None,
        namespace=args.namespace or default_namespace(),
        nodes=args.nodes, nproc_per_node=args.nproc_per_node, gpus_per_node=args.gpus_per_node,
        cpu_request=args.cpu_request, cpu_limit=args.cpu_limit, memory_request=args.memory_request,
        memory_limit=args.memory_limit, shm_size=args.shm_size or None, pvc=args.pvc, mount_path=args.mount_path,
        checkpoint_dir=args.checkpoint_dir,
        node_selector=parse_key_values(args.node_selector, "--node-selector"), tolerations=tolerations,
        gpu_toleration=args.gpu_toleration, rdma_resources=parse_key_values(args.rdma_resource, "--rdma-resource"),
        priority_class=args.priority_class, image_pull_secrets=list(args.image_pull_secret),
        image_pull_policy=args.image_pull_policy, service_account=args.service_account,
        env=parse_key_values(args.env, "--env"), secret_env=parse_key_values(args.env_secret, "--env-secret"),
        env_from_secrets=list(args.env_from_secret), labels=parse_key_values(args.label, "--label"),
        annotations=parse_key_values(args.annotation, "--annotation"), owner=args.owner,
        restart_policy=args.restart_policy, backoff_limit=args.backoff_limit,
        active_deadline_seconds=args.active_deadline_seconds,
        ttl_seconds_after_finished=args.ttl_seconds_after_finished, clean_pod_policy=args.clean_pod_policy,
        termination_grace_period_s=args.termination_grace_period, start_timeout_s=args.start_timeout, queue=args.queue,
        scheduling_policy=args.scheduling_policy, gpu_memory_gb=args.gpu_memory_gb,
        parallel_layout=args.parallel_layout,
    )
    spec.validate()
    return spec


__all__ = ["LaunchSpecError", "add_spec_flags", "spec_from_args"]
