"""The pretrain step's parameters, declared once.

:class:`PretrainSettings` is the one declaration: a typed dataclass with a docstring per field. The kfp
function (generated into ``components/kfp_functions.py`` by ``components/declare.py``), the pipeline's
pretrain parameters and the step's settings all derive from it, so a new parameter is one new field here.
The training knobs are ``config_field()``s: the domino config field of the same name (type and description
from ``domino/config/schema.py``), left at "not given" so that the preset decides as it does for ``domino
pretrain`` without the flag. The job's knobs are ``job_field()``s: the :class:`~domino.launch.JobSpec` field
they set, whose type and default they take (in kfp's encoding, ``components/declare.py``). Where the pipeline's
default run needs another value, :data:`PIPELINE_RUN` says so, in this one place. kfp parameters are scalars
(str, int, float, bool): structured values (dicts, lists) are JSON strings, parsed and checked by the step
before anything is created.
"""

from __future__ import annotations

from dataclasses import dataclass

from components.declare import config_field, job_field
from components.run_settings import JobTargetSettings, RunSettings, TrackingSettings

#: The pipeline's default run (``domino pipeline run --quick``) where it is not domino's: 20 steps of the tiny
#: preset on one pod of two processes that split every layer (tensor parallelism with Domino), in a job named
#: for the pipeline (a JobSpec has no default name). Every other default is the JobSpec's or the preset's.
PIPELINE_RUN = {"train_iters": 20, "tensor_model_parallel_size": 2, "nproc_per_node": 2, "job_name": "gpt-pretrain"}


@dataclass(kw_only=True)
class PretrainSettings(TrackingSettings, JobTargetSettings, RunSettings):
    """Everything the pretrain step needs besides the dataset (one field per component parameter)."""

    preset: str = "tiny"
    """Model and training preset (tiny, gpt2-125m, gpt3-350m, gpt3-1.3b, ...)."""
    config_overrides: str = "{}"
    """JSON object of further domino config fields, e.g. {"num_layers": 4, "bf16": true}."""
    train_iters: int = config_field(PIPELINE_RUN["train_iters"])
    micro_batch_size: int = config_field()
    global_batch_size: int = config_field()
    lr: float = config_field()
    split: str = config_field()
    tokenizer: str = config_field()
    save_interval: int = config_field()
    eval_interval: int = config_field()
    eval_iters: int = config_field()
    log_interval: int = config_field()
    nodes: int = job_field("nodes")
    """Pods of the training job."""
    nproc_per_node: int = job_field("nproc_per_node", PIPELINE_RUN["nproc_per_node"])
    """Processes per pod."""
    gpus_per_node: int = job_field("gpus_per_node")
    """GPUs per pod (0 trains on CPU)."""
    gpu_memory_gb: float = job_field("gpu_memory_gb")
    """Memory of one GPU in GiB: refuse a layout whose memory estimate does not fit (0: no check)."""
    parallel_layout: str = job_field("parallel_layout")
    """given: tensor_model_parallel_size as set; derive: the smallest TP within one pod that the model admits and
    (with gpu_memory_gb) fits, tensor_model_parallel_size the largest allowed, DP across the pods (a run resumed on
    other nodes continues on the layout they hold; docs/cluster.md)."""
    tensor_model_parallel_size: int = config_field(PIPELINE_RUN["tensor_model_parallel_size"])
    domino_chunks: int = config_field()
    zero_stage: int = config_field()
    warm_start: bool = False
    """Initialise from the promoted model's weights (fresh start when none)."""
    resume_from_run: str = ""
    """Run id of an earlier (preempted) run of this pipeline: continue its training, optimizer state and data position
    included, from its newest checkpoint in <shared_root>/runs/<id>/checkpoints ('': none)."""
    image: str = job_field("image")
    """Image of the training job ('': the domino CUDA image with GPUs, else the CPU one)."""
    job_name: str = job_field("name", PIPELINE_RUN["job_name"])
    """Base name of the training job (the run id is appended)."""
    pvc_name: str = job_field("pvc")
    """ReadWriteMany claim mounted at shared_root by every step and the training job."""
    cpu_request: str = job_field("cpu_request")
    """CPU request per training pod ('': sized from nproc_per_node)."""
    cpu_limit: str = job_field("cpu_limit")
    """CPU limit per training pod ('': none)."""
    memory_request: str = job_field("memory_request")
    """Memory request per training pod ('': sized from nproc_per_node)."""
    memory_limit: str = job_field("memory_limit")
    """Memory limit per training pod ('': none)."""
    shm_size: str = job_field("shm_size")
    """Size limit of /dev/shm in the training pods (memory emptyDir)."""
    rdma_resources: str = job_field("rdma_resources")
    """JSON object RESOURCE -> count: an RDMA device plugin's resources per training pod, plus IPC_LOCK (the fast
    network: docs/cluster.md; the namespace must allow it)."""
    node_selector: str = job_field("node_selector")
    """JSON object of node labels for the training pods."""
    tolerations: str = job_field("tolerations")
    """JSON array of tolerations for the training pods ('key=value:effect' strings or objects)."""
    priority_class: str = job_field("priority_class")
    """PriorityClass of the training pods ('': none)."""
    service_account: str = job_field("service_account")
    """ServiceAccount of the training pods ('': the namespace's default; no token is mounted)."""
    image_pull_secrets: str = job_field("image_pull_secrets")
    """JSON array of Secret names for pulling the training image."""
    env: str = job_field("env")
    """JSON object of extra environment variables of the training container (overrides NCCL defaults); literal
    values, stored with the run: nothing secret (use env_secrets)."""
    env_secrets: str = job_field("secret_env")
    """JSON object NAME -> "SECRET:KEY": environment variables read from Kubernetes Secrets when the pods start."""
    env_from_secrets: str = job_field("env_from_secrets")
    """JSON array of Secret names whose every key becomes an environment variable (PyTorchJob only)."""
    labels: str = job_field("labels")
    """JSON object of extra labels on the training job and its pods."""
    annotations: str = job_field("annotations")
    """JSON object of extra annotations on the training job and its pods."""
    queue: str = job_field("queue")
    """Kueue LocalQueue of the training job ('': none); Kueue holds it suspended until admitted."""
    queue_timeout_s: int = 86400
    """Fail when the queued job is not admitted after this many seconds (0: no limit but job_timeout_s)."""
    backoff_limit: int = job_field("backoff_limit")
    """Container restarts, summed over the training pods, before the job fails (-1: 3 x nodes)."""
    termination_grace_period_s: int = job_field("termination_grace_period_s")
    """Seconds a training pod has to save a checkpoint after SIGTERM."""
    job_timeout_s: int = 0
    """Wall-clock limit of the training job, also its activeDeadlineSeconds (0: none)."""
    scheduling_timeout_s: int = 600
    """Fail when the admitted training job does not have all its pods running after this many seconds."""


#: Settings that hold JSON, with the JSON type they must have.
JSON_SETTINGS = {"config_overrides": dict, "node_selector": dict, "rdma_resources": dict, "tolerations": list,
                 "image_pull_secrets": list,
                 "env": dict, "env_secrets": dict, "env_from_secrets": list, "labels": dict, "annotations": dict}
