"""Logic of the pretrain step: settings -> validated ``domino pretrain`` flags -> a job -> artifacts.

Plain Python, no kfp. The step validates the whole training config before it creates anything, launches
the job through :func:`domino.launch.run_job` (a PyTorchJob or TrainJob, ``job_api``, in a cluster or as
local processes), fails when the job fails, and summarises the final checkpoint and the metrics file for the artifacts.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List

from domino import images
from components.declare import config_values, settings_parameters
from components.layout import RunLayout
from components.manifest import read_manifest, write_manifest
from components.pretrain.settings import JSON_SETTINGS, PretrainSettings
from components.registry import current_model
from domino.config.flags import flag_name
from domino.launch import run_job
from domino.launch.api import BACKENDS
from domino.launch.job_api import job_api
from domino.launch.naming import label_value
from domino.launch.pretrain_args import resolve_pretrain
from domino.launch.spec import DEFAULT_MOUNT_PATH, JobSpec, Toleration, credential_names, default_namespace
from domino.tracking import CREDENTIAL_KEYS, CREDENTIAL_SECRET, KFP_RUN_ID_ENV, TRACKING_URI_ENV, read_pointer
from domino.tracking.registry import volume_uri

__all__ = ["PretrainFailed", "PretrainSettings", "job_spec", "load_argv", "metric_values",
           "parse_overrides", "pretrain_argv", "run_pretrain"]

#: Config fields the run's layout sets (``config_overrides`` may not set them either).
LAYOUT_FIELDS = ("data_path", "save", "load", "finetune", "metrics_file")


class PretrainFailed(RuntimeError):
    """The training job did not succeed; the message holds the job's outcome and last log lines."""


def parse_overrides(text: str) -> Dict[str, Any]:
    """``config_overrides`` (a JSON object of config fields) as a dict; rejects the step's own settings."""
    try:
        overrides = json.loads(text or "{}")
    except json.JSONDecodeError as error:
        raise ValueError(f"config_overrides: not JSON ({error}); expected e.g. {{\"num_layers\": 4}}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"config_overrides: expected a JSON object, got {type(overrides).__name__}")
    own = {p.name for p in settings_parameters(PretrainSettings) if p.config}
    for key in overrides:
        name = key.replace("-", "_")
        if name in own:
            raise ValueError(f"config_overrides: '{key}' is a parameter of its own; set the parameter '{name}'")
        if name in LAYOUT_FIELDS:
            raise ValueError(f"config_overrides: '{key}' is set by the run's layout (warm_start, the dataset, "
                             "<shared_root>/runs/<run_id>), not here")
    return overrides


def overrides_to_argv(overrides: Dict[str, Any]) -> List[str]:
    """``{"num_layers": 4, "bf16": True}`` -> ``["--num-layers", "4", "--bf16"]``."""
    argv: List[str] = []
    for key, value in overrides.items():
        flag = flag_name(key.replace("-", "_"))
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def pretrain_argv(settings: PretrainSettings, data_prefix: str, layout: RunLayout) -> List[str]:
    """The ``domino pretrain`` flags of this run (warm start resolved against the registry): the preset, the
    overrides, every config parameter that is given, and the run's layout."""
    s = settings
    argv = ["--preset", s.preset, *overrides_to_argv(parse_overrides(s.config_overrides)),
            *overrides_to_argv(config_values(s))]
    argv += ["--data-path", data_prefix, "--metrics-file", layout.metrics_file, "--save", layout.checkpoint_dir]
    argv += load_argv(s.warm_start, layout, s.resume_from_run)
    return argv


def load_argv(warm_start: bool, layout: RunLayout, resume_from_run: str = "") -> List[str]:
    """``--load`` flags: this run's own checkpoints when a retried job left some (resume), else with
    ``resume_from_run`` the earlier run's checkpoints (a full resume under this run's id: it saves into its own
    folder from then on), else the promoted model's weights with ``--finetune`` when warm-starting and one
    exists, else this run's (empty) save dir."""
    from domino.checkpoint.on_disk import find_latest_checkpoint  # imports torch: not at pipeline compile time

    own = find_latest_checkpoint(layout.checkpoint_dir)
    if resume_from_run:
        if warm_start:
            raise ValueError("resume_from_run and warm_start: choose one (a resume continues the run, optimizer "
                             "state included; a warm start takes the promoted model's weights only)")
        earlier = RunLayout(layout.root, resume_from_run)  # refuses a run id that is not a folder name
        if own is None and find_latest_checkpoint(earlier.checkpoint_dir) is None:
            raise ValueError(f"resume_from_run {resume_from_run!r}: {earlier.checkpoint_dir} holds no checkpoint")
        if own is None:
            return ["--load", earlier.checkpoint_dir]
    if own is None and warm_start:
        promoted = current_model(layout.registry_path)
        if promoted is not None:
            return ["--load", promoted.checkpoint_dir, "--finetune"]
    return ["--load", layout.checkpoint_dir]


def _json_param(settings: PretrainSettings, name: str) -> Any:
    """The JSON setting ``name`` parsed, with its declared JSON type checked."""
    kind = JSON_SETTINGS[name]
    text = getattr(settings, name)
    try:
        value = json.loads(text or ("{}" if kind is dict else "[]"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{name}: not JSON ({error})") from None
    if not isinstance(value, kind):
        raise ValueError(f"{name}: expected a JSON {'object' if kind is dict else 'array'}, got {text!r}")
    return value


def _literal_env(env: Dict[str, str]) -> Dict[str, str]:
    """The literal ``env`` parameter, refusing a variable whose name says it holds a credential."""
    secret = credential_names(env)  # the same rule as `domino launch --env` (domino/launch/spec.py)
    if secret:
        raise ValueError(f"env: {', '.join(secret)} look(s) like credentials, and run parameters are stored in plain "
                         "text: put the value in a Kubernetes Secret and name it in env_secrets "
                         '({"NAME": "SECRET:KEY"}) or env_from_secrets')
    return env


def job_spec(settings: PretrainSettings, argv: List[str]):
    """The :class:`domino.launch.JobSpec` of this run's training job (validated).

    The restart policy is the launcher's default (OnFailure with a backoffLimit scaled by the node
    count): a lost pod makes its peers exit 1, which ExitCode would treat as permanent.
    """
    s = settings
    tolerations = []
    for item in _json_param(s, "tolerations"):
        if isinstance(item, str):
            tolerations.append(Toleration.parse(item))
        elif isinstance(item, dict):
            tolerations.append(Toleration(**item))
        else:
            raise ValueError(f"tolerations: {item!r} is neither 'key=value:effect' nor an object")
    text = lambda d: {str(k): str(v) for k, v in d.items()}  # noqa: E731 - JSON scalars -> strings
    # Without GPUs DeepSpeed must be told to use its CPU accelerator.
    env = {"DS_ACCELERATOR": "cpu"} if s.gpus_per_node == 0 else {}
    tracked = bool(s.mlflow_tracking_uri)  # the job's rank 0 logs to MLflow, its run tagged with this pipeline run
    if tracked:
        env.update({TRACKING_URI_ENV: s.mlflow_tracking_uri, KFP_RUN_ID_ENV: s.run_id})
    literal_env = _literal_env(text(_json_param(s, "env")))
    # The tracking credentials: optional references (the Secret may hold none of them); a variable the run's
    # env or env_secrets sets itself is the user's.
    tracking_credentials = {key: CREDENTIAL_SECRET for key in CREDENTIAL_KEYS if tracked and key not in literal_env}
    spec = JobSpec(
        name=s.job_name, image=s.image or images.for_gpus(s.gpus_per_node), pretrain_args=argv,
        namespace=s.namespace or default_namespace(), nodes=s.nodes, nproc_per_node=s.nproc_per_node,
        gpus_per_node=s.gpus_per_node, cpu_request=s.cpu_request or None, cpu_limit=s.cpu_limit or None,
        memory_request=s.memory_request or None, memory_limit=s.memory_limit or None, shm_size=s.shm_size or None,
        # Locally the shared root stands in for the volume at its usual mount path (the local backend maps
        # that path back to the shared root); the run's paths all lie under the shared root itself.
        pvc=s.pvc_name, mount_path=s.shared_root if s.backend == "cluster" else DEFAULT_MOUNT_PATH,
        checkpoint_dir=RunLayout(s.shared_root, s.run_id).checkpoint_dir,
        node_selector=text(_json_param(s, "node_selector")), tolerations=tolerations,
        rdma_resources=text(_json_param(s, "rdma_resources")),
        priority_class=s.priority_class or None, service_account=s.service_account or None,
        image_pull_secrets=[str(x) for x in _json_param(s, "image_pull_secrets")],
        env={**env, **literal_env},
        secret_env={**tracking_credentials, **text(_json_param(s, "env_secrets"))},
        env_from_secrets=[str(x) for x in _json_param(s, "env_from_secrets")],
        labels={**text(_json_param(s, "labels")), "pipelines.kubeflow.org/run-id": label_value(s.run_id)},
        annotations=text(_json_param(s, "annotations")), queue=s.queue or None,
        backoff_limit=None if s.backoff_limit < 0 else s.backoff_limit,
        termination_grace_period_s=s.termination_grace_period_s, gpu_memory_gb=s.gpu_memory_gb or None,
        parallel_layout=s.parallel_layout,
    )
    spec.validate()
    return spec


def summarize(layout: RunLayout, seq_length: int) -> Dict[str, Any]:
    """Facts about the finished run: final checkpoint, iterations, tokens, final losses, throughput."""
    # torch and matplotlib: only where a run is summarised, not when the pipeline is compiled.
    from domino.checkpoint.on_disk import Checkpoint, find_latest_checkpoint
    from domino.eval.report_plots import read_metrics

    found = find_latest_checkpoint(layout.checkpoint_dir)
    if found is None:
        raise PretrainFailed(f"the job succeeded but left no checkpoint in {layout.checkpoint_dir}")
    ckpt = Checkpoint.read(found)  # checkpoint.json read and checked once
    meta = ckpt.meta
    train, evals = read_metrics(layout.metrics_file) if os.path.exists(layout.metrics_file) else ([], [])
    # The first logged interval includes start-up and compilation; leave it out of throughput when possible.
    steady = train[1:] or train
    summary: Dict[str, Any] = {
        "checkpoint_dir": layout.checkpoint_dir, "checkpoint": str(ckpt), "iterations": int(meta["iteration"]),
        "consumed_samples": int(meta["consumed_samples"]),
        "tokens_seen": int(meta["consumed_samples"]) * seq_length, "metrics_file": layout.metrics_file,
        "config": meta["config"],
    }
    pointer = read_pointer(layout.checkpoint_dir)
    if pointer is not None:  # the MLflow run of the training, on the KFP outputs
        summary["mlflow_run_id"] = pointer.run_id
    if train:
        summary["final_train_loss"] = float(train[-1]["lm_loss"])
    valid = [e for e in evals if e.get("eval") == "valid"]
    if valid:
        summary["final_valid_loss"] = float(valid[-1]["lm_loss"])
    for key, out in (("tokens_per_s", "tokens_per_s"), ("mfu", "mfu"), ("tflops_per_device", "tflops_per_device")):
        values = [float(r[key]) for r in steady if isinstance(r.get(key), (int, float))]
        if values:
            summary[out] = sum(values) / len(values)
    return summary


def run_pretrain(
    settings: PretrainSettings, dataset_manifest: str, model_path: str, log: Callable[[str], None] = print
) -> Dict[str, Any]:
    """Runs the training job for ``settings`` on the dataset and writes the model manifest.

    Args:
        settings: The step's parameters.
        dataset_manifest: Path of the preprocess step's ``Dataset`` artifact.
        model_path: Where to write the ``Model`` artifact (a manifest naming the checkpoint).
        log: Receives job status and log lines.

    Returns:
        The summary written to the model manifest (see :func:`summarize`) plus ``job``, ``warm_start_from``,
        ``world_size`` and ``train_wall_s`` (the job's wall-clock seconds, scheduling included).

    Raises:
        ValueError / ConfigError / LaunchSpecError: bad settings, before any job exists.
        PretrainFailed: the job failed, timed out or was interrupted.
    """
    layout = RunLayout(settings.shared_root, settings.run_id)
    if settings.backend not in BACKENDS:
        raise ValueError(f"backend: {settings.backend!r} is not one of {', '.join(BACKENDS)}")
    data_prefix = read_manifest(dataset_manifest, "dataset")["prefix"]
    argv = pretrain_argv(settings, data_prefix, layout)
    # The pods' argv, its layout derived and its flags parsed and checked once; the job runs exactly that.
    resolved = resolve_pretrain(job_spec(settings, argv))
    config = resolved.config
    job_api(settings.job_api).check(resolved.spec)  # an unknown job_api, or what it cannot carry, fails before work
    os.makedirs(layout.run_dir, exist_ok=True)
    warm_from = argv[argv.index("--load") + 1] if "--finetune" in argv else ""
    log(f"pretrain: job {settings.job_name} ({settings.job_api}, {settings.backend}), "
        f"warm start from: {warm_from or 'none'}")
    started = time.monotonic()
    result = run_job(
        resolved, backend=settings.backend, api=settings.job_api, timeout_s=settings.job_timeout_s or None,
        scheduling_timeout_s=settings.scheduling_timeout_s, queue_timeout_s=settings.queue_timeout_s or None,
        cleanup="on-success", run_id=settings.run_id,
        log=log, workdir=settings.shared_root if settings.backend == "local" else None,
    )
    if not result.succeeded:
        raise PretrainFailed(result.describe())
    summary = summarize(layout, config.model.seq_length)
    summary.update(job=result.name, warm_start_from=warm_from, run_id=settings.run_id,
                   world_size=settings.nodes * settings.nproc_per_node,
                   train_wall_s=round(time.monotonic() - started, 1),
                   # Where the final checkpoint lies, as any namespace that mounts the claim finds it.
                   checkpoint_uri=volume_uri(summary["checkpoint"], settings.shared_root, settings.pvc_name))
    write_manifest(model_path, summary)
    return summary


def metric_values(summary: Dict[str, Any]) -> Dict[str, float]:
    """The numbers logged to the ``Metrics`` artifact."""
    keys = ("final_train_loss", "final_valid_loss", "tokens_per_s", "mfu", "tflops_per_device", "iterations",
            "tokens_seen")
    return {k: float(summary[k]) for k in keys if k in summary}

