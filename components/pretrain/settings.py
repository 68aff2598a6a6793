"""The pretrain step's parameters, declared once.

:class:`PretrainSettings` is the one declaration: a typed dataclass with a docstring per field. The
kfp component's signature (``component.py``), the pipeline's pretrain parameters
(``pipelines/gpt_pretrain.py``) and the step's settings (``step.py``) are all derived from it, so a new
parameter is one new field here. kfp parameters are scalars (str, int, float, bool): structured
values (dicts, lists) are JSON strings, parsed and checked by the step before anything is created.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List

from domino.config.flags import field_docs
from domino.launch.job_api import DEFAULT_JOB_API


@dataclass
class PretrainSettings:
    """Everything the pretrain step needs besides the dataset (one field per component parameter)."""

    shared_root: str
    """Mount path of the shared volume (or a local folder with backend=local)."""
    run_id: str
    """Unique run id; the job name and folders derive from it."""
    preset: str = "tiny"
    """Model and training preset (tiny, gpt2-125m, gpt3-350m, gpt3-1.3b, ...)."""
    config_overrides: str = "{}"
    """JSON object of further domino config fields, e.g. {"num_layers": 4, "bf16": true}."""
    train_iters: int = 20
    """Optimizer steps."""
    micro_batch_size: int = 4
    """Samples per process per pass (divisible by domino_chunks)."""
    global_batch_size: int = 0
    """Samples per optimizer step (0: micro batch x data-parallel size)."""
    lr: float = 0.0
    """Peak learning rate (0: the preset's)."""
    split: str = "90,5,5"
    """Train/valid/test split of the documents."""
    tokenizer: str = "gpt2"
    """Tokenizer used by preprocess (gpt2 works offline)."""
    save_interval: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    eval_interval: int = 10
    """Validate every N steps."""
    eval_iters: int = 2
    """Batches per validation during training."""
    log_interval: int = 5
    """Log a metrics line every N steps."""
    nodes: int = 1
    """Pods of the training job."""
    nproc_per_node: int = 2
    """Processes per pod."""
    gpus_per_node: int = 0
    """GPUs per pod (0 trains on CPU)."""
    gpu_memory_gb: float = 0.0
    """Memory of one GPU in GiB: refuse a layout whose memory estimate does not fit (0: no check)."""
    tensor_parallel: int = 2
    """Tensor-parallel size (divides nodes x nproc_per_node)."""
    domino_chunks: int = 2
    """Domino micro-chunks per layer (1: plain tensor parallelism)."""
    zero_stage: int = -1
    """DeepSpeed ZeRO stage (0, 1, 2; -1: the resumed checkpoint's, else 0 with one data-parallel replica
    without bf16, else 1)."""
    warm_start: bool = False
    """Initialise from the promoted model's weights (fresh start when none)."""
    backend: str = "cluster"
    """cluster (a job created through the Kubernetes API) or local (processes in the step's pod)."""
    job_api: str = DEFAULT_JOB_API
    """pytorchjob (Kubeflow training operator v1) or trainjob (Kubeflow Trainer v2.3, runtime from k8s/trainer)."""
    image: str = ""
    """Image of the training job ('': the components' image)."""
    namespace: str = ""
    """Namespace of the training job ('': the step's own namespace, POD_NAMESPACE)."""
    job_name: str = "gpt-pretrain"
    """Base name of the training job (the run id is appended)."""
    pvc_name: str = "domino-data"
    """ReadWriteMany claim mounted at shared_root by every step and the training job."""
    cpu_request: str = ""
    """CPU request per training pod ('': sized from nproc_per_node)."""
    cpu_limit: str = ""
    """CPU limit per training pod ('': none)."""
    memory_request: str = ""
    """Memory request per training pod ('': sized from nproc_per_node)."""
    memory_limit: str = ""
    """Memory limit per training pod ('': none)."""
    shm_size: str = "16Gi"
    """Size limit of /dev/shm in the training pods (memory emptyDir)."""
    node_selector: str = "{}"
    """JSON object of node labels for the training pods."""
    tolerations: str = "[]"
    """JSON array of tolerations for the training pods ('key=value:effect' strings or objects)."""
    priority_class: str = ""
    """PriorityClass of the training pods ('': none)."""
    service_account: str = ""
    """ServiceAccount of the training pods ('': the namespace's default; no token is mounted)."""
    image_pull_secrets: str = "[]"
    """JSON array of Secret names for pulling the training image."""
    env: str = "{}"
    """JSON object of extra environment variables of the training container (overrides NCCL defaults)."""
    labels: str = "{}"
    """JSON object of extra labels on the training job and its pods."""
    annotations: str = "{}"
    """JSON object of extra annotations on the training job and its pods."""
    queue: str = ""
    """Kueue LocalQueue of the training job ('': none); Kueue holds it suspended until admitted."""
    queue_timeout_s: int = 86400
    """Fail when the queued job is not admitted after this many seconds (0: no limit but job_timeout_s)."""
    backoff_limit: int = -1
    """Container restarts, summed over the training pods, before the job fails (-1: 3 x nodes)."""
    termination_grace_period_s: int = 180
    """Seconds a training pod has to save a checkpoint after SIGTERM."""
    job_timeout_s: int = 0
    """Wall-clock limit of the training job, also its activeDeadlineSeconds (0: none)."""
    scheduling_timeout_s: int = 600
    """Fail when the admitted training job does not have all its pods running after this many seconds."""
    mlflow_tracking_uri: str = ""
    """MLflow server that training, evaluation and promotion log to ('': none; credentials: a Secret, see docs)."""


#: Settings the pipeline supplies itself rather than as a pipeline parameter of the same name.
RUN_SUPPLIED = ("run_id",)
#: Settings that hold JSON, with the JSON type they must have.
JSON_SETTINGS = {"config_overrides": dict, "node_selector": dict, "tolerations": list, "image_pull_secrets": list,
                 "env": dict, "labels": dict, "annotations": dict}


def settings_fields() -> List[dataclasses.Field]:
    """The fields of :class:`PretrainSettings` in declaration order."""
    return list(dataclasses.fields(PretrainSettings))


def parameter_docs() -> Dict[str, str]:
    """``{parameter: one-line description}`` (the field docstrings)."""
    return {name: " ".join(doc.split()) for name, doc in field_docs(PretrainSettings).items()}


def parameters(skip: tuple = ()) -> List[inspect.Parameter]:
    """The settings as keyword parameters (annotation and default from the declaration)."""
    out = []
    for f in settings_fields():
        if f.name in skip:
            continue
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        annotation = {"str": str, "int": int, "float": float, "bool": bool}[str(f.type)]
        out.append(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                     annotation=annotation))
    return out


def settings_from_kwargs(values: Dict[str, Any]) -> PretrainSettings:
    """Settings from keyword values; keys that are not settings (other steps' parameters) are ignored."""
    names = {f.name for f in settings_fields()}
    return PretrainSettings(**{k: v for k, v in values.items() if k in names})
