"""Settings that several components share, declared once (each component's settings inherit them).

Every settings class is ``kw_only``: inherited fields may then precede fields without defaults, and the
generated kfp functions take keywords only (kfp calls them with keywords).
"""

from __future__ import annotations

from dataclasses import dataclass

from components.declare import job_field
from domino.launch.job_api import DEFAULT_JOB_API


@dataclass(kw_only=True)
class VolumeSettings:
    """Where the shared volume is."""

    shared_root: str
    """Mount path of the shared volume (or a local folder with backend=local)."""


@dataclass(kw_only=True)
class RunIdSettings:
    """Which run."""

    run_id: str
    """Unique run id; the run's folders and its training job's name derive from it."""


@dataclass(kw_only=True)
class RunSettings(RunIdSettings, VolumeSettings):
    """The shared volume and the run."""


@dataclass(kw_only=True)
class TrackingSettings:
    """Where runs and promotions are tracked."""

    mlflow_tracking_uri: str = ""
    """MLflow server that training, evaluation and promotion log to ('': none; credentials: a Secret, see docs)."""


@dataclass(kw_only=True)
class CorpusSettings:
    """What text the run tokenizes."""

    corpus: str = "shakespeare"
    """Built-in corpus to train on when input_uri is empty (shakespeare, kjv)."""
    input_uri: str = ""
    """Comma-separated files, directories, globs or file:// URIs on the shared volume (overrides corpus):
    .jsonl/.txt, optionally .gz or .zst, and .parquet."""
    json_keys: str = "text"
    """Comma-separated JSON keys (Parquet columns) whose texts are tokenized."""


@dataclass(kw_only=True)
class ReuseSettings:
    """Whether a finished dataset is reused."""

    reuse_dataset: bool = True
    """Reuse the dataset an earlier run made from the same files and tokenizer."""


@dataclass(kw_only=True)
class JobTargetSettings:
    """Which API and where the run's training job is created."""

    backend: str = "cluster"
    """cluster (a job created through the Kubernetes API) or local (processes in the step's pod)."""
    job_api: str = DEFAULT_JOB_API
    """pytorchjob (Kubeflow training operator v1) or trainjob (Kubeflow Trainer v2.3, runtime from k8s/trainer)."""
    namespace: str = job_field("namespace")
    """Namespace of the training job ('': the step's own namespace, POD_NAMESPACE)."""
