"""domino: GPT pretraining with Domino-style tensor parallelism, shipped as Kubeflow Pipelines components."""

__version__ = "0.1.0"
