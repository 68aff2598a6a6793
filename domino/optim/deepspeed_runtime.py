"""DeepSpeed in this process: the release we checked, its import, its accelerator and its comm layer.

Everything domino knows of DeepSpeed's process-wide state lives here, beside the optimizers that use it
(:mod:`domino.optim.deepspeed_optimizer`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Optional

import torch

logger = logging.getLogger(__name__)

#: The DeepSpeed release whose source every DeepSpeed detail in domino was read against (the subclasses of
#: ``deepspeed_engine`` and ``deepspeed_subclasses`` with the steps of ``bf16_step``, ``device_loss_scale`` and
#: ``zero_step``, the memory formulas, the cited line numbers).
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


@functools.lru_cache(maxsize=None)
def prepare() -> None:
    """Imports DeepSpeed with its accelerator chosen (plain gloo on CPU) and names an untested release; once per
    process (an in-process restart builds its optimizer again), and only in a run whose optimizer is DeepSpeed's:
    a ZeRO 0 fp32 run never imports it (:func:`domino.optim.build.build_optimizer`)."""
    _skip_shared_memory_op()
    # Only now, with DS_ACCELERATOR set: DeepSpeed picks its accelerator once, at import (deepspeed 0.19.8
    # runtime/utils.py calls get_accelerator() at module level; accelerator/real_accelerator.py caches it).
    import_deepspeed()
    import deepspeed

    line = untested_deepspeed(deepspeed.__version__)
    if line:
        logger.warning("%s", line)


def start_comm() -> None:
    """DeepSpeed's comm layer over torch.distributed's world (after the process groups exist; again after an
    in-process restart formed new ones)."""
    import deepspeed

    # DeepSpeed keeps no communicator of its own on top: deepspeed.comm's backend answers is_initialized() from
    # torch.distributed (deepspeed 0.19.8 comm/torch.py), so after a restart this only finds torch's new world.
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)


def stop_comm() -> None:
    """Destroys every process group through DeepSpeed's comm layer, which also drops DeepSpeed's own references to
    them (deepspeed 0.19.8 comm/comm.py ``destroy_process_group`` -> utils/groups.py
    ``_release_process_group_references``): an in-process restart's :func:`domino.runtime.restart.leave`. A run
    that never started DeepSpeed's comm layer (ZeRO 0 in fp32) destroys them through torch alone."""
    comm = sys.modules.get("deepspeed.comm")
    if comm is not None and comm.is_initialized():
        comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()
