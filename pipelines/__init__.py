"""Kubeflow pipelines of domino and the helpers to compile, run locally, submit and schedule them.

Importing this package imports kfp; ``domino`` itself never imports it (the ``domino pipeline`` verb
imports it lazily).
"""

from pipelines.gpt_pretrain import COMPILED_PATH, MOUNT_PATH, PIPELINE_NAME, StepPlacement, build_pipeline, compile_pipeline

__all__ = ["COMPILED_PATH", "MOUNT_PATH", "PIPELINE_NAME", "StepPlacement", "build_pipeline", "compile_pipeline"]
