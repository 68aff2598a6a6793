"""Settings a :class:`~domino.launch.spec.JobSpec` leaves unset, derived from the job's shape in one place.

Each rule and where it comes from:

* **Requests** (``cpu_request``/``memory_request``): a pod without any CPU or memory request or limit
  is *BestEffort*, the first to be evicted under node memory pressure (Kubernetes docs, "Pod Quality
  of Service Classes"); ``nvidia.com/gpu`` does not count toward QoS. So every job requests CPU and
  memory per training process: :data:`GPU_PROCESS_REQUESTS` on GPU pods (a data-loader worker and
  pinned host buffers per rank), :data:`CPU_PROCESS_REQUESTS` on CPU-only pods (the cpu-smoke quota).
* **backoffLimit**: the operator compares it with the sum of container restart counts over all pods
  (kubeflow/trainer release-1.9, ``pkg/core/job.go`` ``PastBackoffLimit``), and one lost pod makes
  every other rank fail too, so one fault costs ``nodes`` restarts; the job fails when the sum *reaches* the
  limit (``>=``), so the default survives :data:`FAULTS_TOLERATED` - 1 faults and fails at the next.
* **GPU toleration** (:data:`GPU_TOLERATION`): GPU node pools are commonly tainted
  ``nvidia.com/gpu:NoSchedule`` so that other pods stay off them; the NVIDIA device plugin tolerates
  exactly that (NVIDIA/k8s-device-plugin ``deployments/static/nvidia-device-plugin.yml``: key
  ``nvidia.com/gpu``, operator Exists, effect NoSchedule), and so do GPU pods here unless
  ``gpu_toleration`` is off or the spec tolerates that key itself. Where no node carries the taint it
  changes nothing.
* **Environment on GPU pods** (:data:`GPU_ENV`, each overridable by ``--env``):
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` makes kernels launch in issue order, which tensor-parallel
  communication/compute overlap relies on (Megatron-LM refuses sequence parallelism and async TP
  all-reduce without it, ``megatron/training/arguments.py``); ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``
  tears a rank down when NCCL fails (a dead peer) instead of hanging, so the pod exits and is
  restarted (PyTorch docs, "PYTORCH ProcessGroupNCCL Environment Variables"; 3 is the default of
  recent torch, set for older ones); ``NCCL_DEBUG=WARN`` prints NCCL's reason on failure.
* **torchrun's shutdown timeout** (:func:`shutdown_timeout_s`, every pod, overridable by ``--env``): on
  SIGTERM torchrun forwards the signal to its workers, waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds
  (default 30) and then SIGKILLs them, whatever the pod's grace period (torch 2.13
  ``distributed/launcher/api.py`` ``LaunchConfig.__post_init__`` reads the variable;
  ``elastic/agent/server/api.py`` ``SimpleElasticAgent.run`` calls ``_shutdown(e.sigval,
  timeout=self._shutdown_timeout)`` on ``SignalException``; ``elastic/multiprocessing/api.py``
  ``SubprocessContext._close`` waits that long, then sends SIGKILL). So a save after SIGTERM that needs
  more than 30 s never finished. The timeout is derived from ``terminationGracePeriodSeconds`` minus
  :func:`shutdown_margin_s`, the time torchrun needs to kill what is left and exit before the kubelet's SIGKILL.
* **torchrun's rendezvous timeout** (``PET_RDZV_CONF=timeout=<start_timeout_s>``, every pod, overridable
  by ``--env``): torchrun's default backend is ``static`` (torch 2.13 ``distributed/run.py``), whose
  handler reads ``timeout`` from ``--rdzv-conf`` (default 600 s, ``elastic/rendezvous/static_tcp_rendezvous.py``
  ``create_rdzv_handler``) and gives it to the TCPStore: node 0 waits that long for every node to join,
  the others that long to reach node 0. ``--rdzv-conf`` takes its value from ``PET_RDZV_CONF``
  (``distributed/argparse_util.py`` ``env``). A node still pulling the image after 600 s would fail the
  started ones, and with them a restart of the budget, so the wait covers a cold pull (:attr:`JobSpec.start_timeout_s`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

from domino.launch.spec import JobSpec, Toleration

#: (CPU, memory) requested per training process on GPU pods.
GPU_PROCESS_REQUESTS: Tuple[int, int] = (4, 16)
#: (CPU, memory in Gi) requested per training process on CPU-only pods.
CPU_PROCESS_REQUESTS: Tuple[int, int] = (1, 2)
#: The fault (each restarting every pod once) at which the default backoffLimit fails the job.
FAULTS_TOLERATED = 3
#: The variable torchrun reads its workers' shutdown timeout from (torch ``distributed/launcher/api.py``).
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: The variable torchrun reads ``--rdzv-conf`` from (torch ``distributed/run.py``, ``action=env``).
RDZV_CONF_ENV = "PET_RDZV_CONF"
#: The same restart budget for a TrainJob, as its runtime's JobSet ``failurePolicy.maxRestarts``: the
#: operator fails a PyTorchJob when the summed restarts *reach* backoffLimit (``>=``), i.e. at the
#: FAULTS_TOLERATED-th fault after FAULTS_TOLERATED - 1 recoveries; JobSet v0.12.0 recreates the whole set
#: on a failed Job until ``status.restarts`` reaches maxRestarts (``failure_policy.go``
#: ``restartJobSetActionApplier``), i.e. it fails at fault maxRestarts + 1. Both end at the same fault.
JOBSET_MAX_RESTARTS = FAULTS_TOLERATED - 1
#: The toleration GPU pods get by default.
GPU_TOLERATION = Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
#: Environment of GPU training pods unless ``--env`` sets the variable.
GPU_ENV: Dict[str, str] = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "NCCL_DEBUG": "WARN",
}


def processes_per_pod(spec: JobSpec) -> int:
    """Training processes in one pod: ``nproc_per_node`` when numeric, else the GPUs (or 1)."""
    if isinstance(spec.nproc_per_node, int):
        return spec.nproc_per_node
    return max(1, spec.gpus_per_node)


def requests(spec: JobSpec) -> Dict[str, str]:
    """CPU and memory requests of one pod: the spec's, else sized from the processes per pod."""
    cpu, mem = GPU_PROCESS_REQUESTS if spec.gpus_per_node > 0 else CPU_PROCESS_REQUESTS
    procs = processes_per_pod(spec)
    return {"cpu": str(spec.cpu_request or cpu * procs), "memory": str(spec.memory_request or f"{mem * procs}Gi")}


def backoff_limit(spec: JobSpec) -> int:
    """``runPolicy.backoffLimit``: the spec's, else :data:`FAULTS_TOLERATED` x nodes."""
    return spec.backoff_limit if spec.backoff_limit is not None else FAULTS_TOLERATED * spec.nodes


def shutdown_margin_s(grace_period_s: int) -> int:
    """Seconds of the grace period left to torchrun after its workers' shutdown timeout: a tenth, at least 5."""
    return max(5, math.ceil(grace_period_s / 10))


def shutdown_timeout_s(grace_period_s: int) -> int:
    """torchrun's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` for a pod with this grace period (180 s -> 162 s)."""
    return max(1, grace_period_s - shutdown_margin_s(grace_period_s))


def environment(spec: JobSpec) -> Dict[str, str]:
    """The training container's extra environment: torchrun's shutdown and rendezvous timeouts, :data:`GPU_ENV`
    on GPU pods, overridden by the spec's."""
    shutdown = {SHUTDOWN_TIMEOUT_ENV: str(shutdown_timeout_s(spec.termination_grace_period_s)),
                RDZV_CONF_ENV: f"timeout={spec.start_timeout_s}"}
    return {**shutdown, **(GPU_ENV if spec.gpus_per_node > 0 else {}), **spec.env}


def secret_environment(spec: JobSpec) -> List[Dict[str, Any]]:
    """The container's ``env`` entries read from Secrets (``valueFrom.secretKeyRef``): ``SECRET:KEY`` is
    required (the kubelet does not start the container without it: CreateContainerConfigError), ``SECRET``
    alone names the key like the variable and is optional (a missing Secret or key leaves the variable
    unset; Kubernetes ``SecretKeySelector.optional``)."""
    entries = []
    for name, ref in sorted(spec.secret_env.items()):
        secret, colon, key = ref.partition(":")
        selector = {"name": secret, "key": key} if colon else {"name": secret, "key": name, "optional": True}
        entries.append({"name": name, "valueFrom": {"secretKeyRef": selector}})
    return entries


def tolerations(spec: JobSpec) -> List[Toleration]:
    """The pod's tolerations: the spec's, plus :data:`GPU_TOLERATION` on GPU pods unless turned off or
    the spec already tolerates ``nvidia.com/gpu``."""
    out = list(spec.tolerations)
    if spec.gpus_per_node > 0 and spec.gpu_toleration and not any(t.key == GPU_TOLERATION.key for t in out):
        out.append(GPU_TOLERATION)
    return out
