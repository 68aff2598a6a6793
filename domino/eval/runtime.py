"""Process setup shared by the evaluation commands: lone process or torchrun, TP groups, device."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from domino.config import ConfigError
from domino.runtime import state


def world_size_from_env() -> int:
    """Number of processes torchrun (or the training operator) started; 1 when run directly."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_tensor_parallel(tensor_model_parallel_size: Optional[int] = None) -> Tuple[int, int]:
    """Initialises ``torch.distributed`` when needed and creates the TP/DP groups.

    A lone process uses no ``torch.distributed`` at all. Under torchrun, or when a test already
    initialised ``torch.distributed``, the TP size defaults to the world size.

    Returns:
        ``(tp_rank, tp_size)`` of this process.

    Raises:
        ConfigError: when the world size is not divisible by ``tensor_model_parallel_size``.
    """
    world = dist.get_world_size() if dist.is_initialized() else world_size_from_env()
    tp = tensor_model_parallel_size or world
    if tp < 1 or world % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the {world} processes")
    if world > 1 or dist.is_initialized():
        state.initialize_distributed()
        state.initialize_model_parallel(tp)
    else:
        state.initialize_model_parallel(1)
    return state.get_tensor_model_parallel_rank(), state.get_tensor_model_parallel_world_size()


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
