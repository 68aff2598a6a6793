"""Starting a training process: the environment CUDA and DeepSpeed read at start, the device checks, and the mesh.

:func:`initialize_runtime` is the training entry points' start (``domino pretrain``, the benchmarks, the
multi-process tests): it starts ``torch.distributed`` and DeepSpeed's comm layer, builds the run's
:class:`~domino.runtime.mesh.ParallelMesh` once and returns it, to be passed down.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import torch

from domino.config import DominoConfig
from domino.config.validate import check_device
from domino.parallel import fp8
from domino.runtime import state
from domino.runtime.mesh import ParallelMesh

logger = logging.getLogger(__name__)

#: The DeepSpeed release whose source every DeepSpeed detail in domino was read against (the class swaps in
#: ``bf16_step``, ``device_loss_scale`` and ``zero_step``, the memory formulas, the cited line numbers).
#: ``pyproject.toml`` admits this release line only; tests/train/test_deepspeed_version.py keeps the two equal.
TESTED_DEEPSPEED = "0.19.8"


def untested_deepspeed(version: str) -> Optional[str]:
    """The one start-up line naming ``version`` when it is not :data:`TESTED_DEEPSPEED`, else None.

    A later patch release of the admitted line may change the private methods domino relies on; the line says so
    before any work, so a step that misbehaves after an upgrade is traced to it at once.
    """
    if version.split("+")[0] == TESTED_DEEPSPEED:
        return None
    return (f"deepspeed {version} is installed; domino's DeepSpeed integration was read and tested against "
            f"{TESTED_DEEPSPEED} only (pip install deepspeed=={TESTED_DEEPSPEED})")


def import_deepspeed() -> None:
    """Imports DeepSpeed, hiding MLflow from its autotuner for the length of the import.

    deepspeed 0.19.8 imports ``autotuning/autotuner.py`` with the package, which tries ``import mlflow`` at
    module level for its own autotuning experiments (domino never runs the autotuner). Where MLflow is
    installed (the ``tracking`` extra) that import alone took 1.5 s of every process's start-up here; domino's
    tracking imports MLflow itself when ``MLFLOW_TRACKING_URI`` asks for it, so it is hidden only when nothing
    imported it yet, and only during DeepSpeed's import (``sys.modules[name] = None`` makes an import raise
    ImportError, which the autotuner catches).
    """
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed  # noqa: F401
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


def _skip_shared_memory_op() -> None:
    """Keeps DeepSpeed on plain gloo on CPU.

    On CPU ``deepspeed.init_distributed`` JIT-compiles a shared-memory communication op (minutes on the
    first run) whose all-reduce crashed in our runs; without it DeepSpeed falls back to torch.distributed.
    """
    if torch.cuda.is_available():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import_deepspeed()
    import deepspeed.comm.torch  # noqa: F401  (make sure the module object exists)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *args, **kwargs: None


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
    """Initialises torch.distributed, DeepSpeed's comm layer and the TP x PP x DP groups for ``config``: once per
    process, by whoever starts the run (``domino pretrain`` before its agreed data checks), before
    :func:`domino.train.pretrain.pretrain`, and again on ``store`` after an in-process restart tore them down
    (:mod:`domino.train.inprocess`). Returns the run's mesh."""
    set_overlap_environment()
    check_this_device(config)
    _skip_shared_memory_op()
    # Only now, with DS_ACCELERATOR set: DeepSpeed picks its accelerator once, at import (deepspeed 0.19.8
    # runtime/utils.py calls get_accelerator() at module level; accelerator/real_accelerator.py caches it).
    import_deepspeed()
    import deepspeed

    line = untested_deepspeed(deepspeed.__version__)
    if line:
        logger.warning("%s", line)
    p = config.parallel
    # lone_process_group: DeepSpeed needs a process group, even for one process.
    mesh = state.start(p.tensor_model_parallel_size, backend=p.distributed_backend,
                       timeout_minutes=p.distributed_timeout_minutes, lone_process_group=True,
                       pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                       context_parallel_size=p.context_parallel_size, store=store)
    # DeepSpeed keeps no communicator of its own on top: deepspeed.comm's backend answers is_initialized() from
    # torch.distributed (deepspeed 0.19.8 comm/torch.py), so after a restart this only finds torch's new world.
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    return mesh
