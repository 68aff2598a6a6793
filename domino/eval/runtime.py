"""Process setup shared by the evaluation commands: lone process or torchrun, TP groups, device."""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from domino.config import ConfigError
from domino.runtime import state
from domino.runtime.mesh import ParallelMesh


def setup_tensor_parallel(tensor_model_parallel_size: Optional[int] = None) -> ParallelMesh:
    """Starts the run's process groups (:func:`domino.runtime.state.start`, the start-up training uses too).

    A lone process uses no ``torch.distributed`` at all. Under torchrun, or when a test already
    initialised ``torch.distributed``, the TP size defaults to the world size.

    Returns:
        the run's mesh, which the evaluation commands pass down.

    Raises:
        ConfigError: when the world size is not divisible by ``tensor_model_parallel_size``.
    """
    return state.start(tensor_model_parallel_size)


def default_device() -> torch.device:
    """This process's GPU (``LOCAL_RANK``) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def is_output_rank() -> bool:
    """Whether this process prints results (global rank 0)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def parse_dtype(name: str) -> torch.dtype:
    """``fp32`` / ``fp16`` / ``bf16`` -> the torch dtype, with a clear error otherwise."""
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if name not in dtypes:
        raise ConfigError(f"--dtype must be one of {', '.join(dtypes)}, got {name!r}")
    return dtypes[name]


def teardown() -> None:
    """Forgets the TP groups and closes ``torch.distributed`` if this process opened it."""
    state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
