"""Starting a training process: the environment CUDA reads at start, the device checks, and the mesh.

:func:`initialize_runtime` is the training entry points' start (``domino pretrain``, the benchmarks, the
multi-process tests): it starts ``torch.distributed``, builds the run's
:class:`~domino.runtime.mesh.ParallelMesh` once and returns it, to be passed down.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from domino.config import DominoConfig
from domino.config.validate import check_device
from domino.parallel import fp8
from domino.runtime import state
from domino.runtime.mesh import ParallelMesh
from domino.runtime.network_emulator import link_from_environment

logger = logging.getLogger(__name__)


def set_overlap_environment() -> None:
    """Sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless the environment already sets it; call before CUDA starts.

    With one hardware queue per device, kernels start in the order they are issued, so the all-reduce a Domino
    chunk launches is queued ahead of the other chunk's GEMMs instead of waiting behind them (Megatron-LM
    requires the same for its asynchronous TP all-reduce, ``megatron/training/arguments.py``). CUDA reads the
    variable when it creates the context, so a process that already used CUDA only gets a warning.
    """
    preset = "CUDA_DEVICE_MAX_CONNECTIONS" in os.environ
    value = os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if value != "1":
        logger.warning("CUDA_DEVICE_MAX_CONNECTIONS=%s: Domino's overlap expects 1 (kernels in issue order)", value)
    elif not preset and torch.cuda.is_initialized():
        logger.warning("CUDA was initialised before CUDA_DEVICE_MAX_CONNECTIONS=1 was set: it has no effect "
                       "in this process (set it in the environment of the launcher)")


def check_this_device(config: DominoConfig) -> None:
    """Raises :class:`ConfigError` for precision or backend settings this machine cannot run (see
    :func:`domino.config.validate.check_device`); DeepSpeed's CPU accelerator decides fp16 support on CPU
    (``deepspeed/accelerator/cpu_accelerator.py``: ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``)."""
    cuda = torch.cuda.is_available()
    cpu_fp16 = False
    if not cuda and config.train.fp16:
        try:
            cpu_fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # older torch builds lack the op: DeepSpeed then reports no fp16 either
            cpu_fp16 = False
    check_device(config, cuda=cuda, cpu_fp16=cpu_fp16)
    if config.train.fp8_format:  # one line saying why neither real nor emulated FP8 runs here (parallelize gives
        # the linears their recipe)
        fp8.recipe(config.train.fp8_format, torch.device("cuda", torch.cuda.current_device()) if cuda
                   else torch.device("cpu"))


def initialize_runtime(config: DominoConfig, store: Optional[torch.distributed.Store] = None) -> ParallelMesh:
    """Initialises torch.distributed and the TP x PP x DP groups for ``config`` (DeepSpeed's comm layer is started
    by the optimizer that needs it, :func:`domino.optim.deepspeed_optimizer.build_deepspeed_optimizer`): once per
    process, by whoever starts the run (``domino pretrain`` before its agreed data checks), before
    :func:`domino.train.pretrain.pretrain`, and again on ``store`` after an in-process restart tore them down
    (:mod:`domino.train.inprocess`). Returns the run's mesh, its TP link emulated as ``DOMINO_SIMULATED_NETWORK``
    asks (read here, once per start, before any work: a malformed value fails before a group exists)."""
    link = link_from_environment()
    set_overlap_environment()
    check_this_device(config)
    p = config.parallel
    # lone_process_group: DeepSpeed needs a process group, even for one process.
    mesh = state.start(p.tensor_model_parallel_size, backend=p.distributed_backend,
                       timeout_minutes=p.distributed_timeout_minutes, lone_process_group=True,
                       pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                       context_parallel_size=p.context_parallel_size, store=store, link=link)
    return mesh
