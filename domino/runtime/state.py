"""Process groups for a tensor-parallel x pipeline-parallel x data-parallel grid.

Ranks are laid out as in Megatron-LM's default order ``tp-cp-ep-dp-pp`` (``RankGenerator`` and
``generate_masked_orthogonal_rank_groups`` in NVIDIA/Megatron-LM ``megatron/core/parallel_state.py``, commit
00caa53), which without context or expert parallelism reads ``global = tp_rank + dp_rank * tp + pp_rank * tp * dp``:
the ``tp`` consecutive ranks form one tensor-parallel group (each holds a slice of every layer of its stage), ranks
with the same TP position and stage form a data-parallel group (ZeRO shards across them), and ranks ``tp * dp``
apart form a pipeline group (one per stage). The embedding group joins the first and the last stage of each pipeline
(Megatron's ``default_embedding_ranks``): the tied word embeddings' gradients are summed over it.

At pipeline size 1 no pipeline or embedding group is created and the grid is Megatron's TP x DP as before.
When nothing is initialised every getter answers as a single process (rank 0, size 1, group ``None``),
so the model runs on one device without ``torch.distributed``. This module also serves as the ``mpu``
object DeepSpeed expects (``get_model_parallel_*`` / ``get_data_parallel_*``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from domino.config import ConfigError, ParallelConfig
from domino.config.validate import check_tensor_parallel_size
from domino.runtime.network_emulator import LinkEmulator, install_from_environment

logger = logging.getLogger(__name__)


@dataclass
class _Groups:
    tp_group: Optional[dist.ProcessGroup]
    tp_ranks: List[int]
    dp_group: Optional[dist.ProcessGroup]
    dp_ranks: List[int]
    pp_group: Optional[dist.ProcessGroup] = None  # None at pipeline size 1
    pp_ranks: List[int] = field(default_factory=list)  # this rank's pipeline, stage 0 first ([rank] at size 1)
    embedding_group: Optional[dist.ProcessGroup] = None  # first + last stage; None at pipeline size 1
    embedding_ranks: List[int] = field(default_factory=list)
    tp_link: Optional[LinkEmulator] = None  # the emulated TP interconnect (DOMINO_SIMULATED_NETWORK), if any


@dataclass(frozen=True)
class RankGrid:
    """Every group of a ``tp x pp x dp`` world as lists of global ranks, in Megatron's order (module docstring)."""

    tp: List[List[int]]
    dp: List[List[int]]
    pp: List[List[int]]
    embedding: List[List[int]]

    @classmethod
    def build(cls, world_size: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int = 1
              ) -> "RankGrid":
        """The groups of ``world_size`` ranks; the sizes must divide it (:func:`check_tensor_parallel_size`)."""
        tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        check_tensor_parallel_size(world_size, tp, pp)
        dp = world_size // (tp * pp)
        per_stage = tp * dp

        def rank(t: int, d: int, p: int) -> int:
            return t + d * tp + p * per_stage

        pipelines = [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]
        return cls(tp=[[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
                   dp=[[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
                   pp=sorted(pipelines),
                   embedding=sorted([ranks[0], ranks[-1]] if len(ranks) > 1 else ranks[:1] for ranks in pipelines))


_STATE: Optional[_Groups] = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a collective over ``group`` needs its tensors on: this process's GPU for NCCL, else CPU.

    NCCL only moves CUDA tensors and gloo reads CPU ones (``check_gpu_single_tensor`` in pytorch/pytorch
    ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`` rejects a CPU tensor: "Tensors must be CUDA and dense"), so
    every small bookkeeping tensor a collective reduces (flags, loss sums) is created here. Without
    ``torch.distributed``: the current CUDA device when there is one, else CPU.
    """
    if dist.is_initialized():
        backend = dist.get_backend(group)
        if "nccl" in str(backend):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _check_nccl_error_handling(environ) -> None:
    """Makes a failed or timed-out NCCL collective end the process instead of hanging it.

    torch's NCCL watchdog reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (legacy ``NCCL_ASYNC_ERROR_HANDLING``):
    3 (SkipCleanUp, torch's default) and 1 (TearDown) tear the process down once a collective exceeds the
    group's timeout; 0 (NoHandling) and 2 (CleanUpOnly) leave it running (torch 2.13
    ``csrc/distributed/c10d/ProcessGroupNCCL.hpp``, ``ErrorHandlingMode``). An explicit 0 or 2 is kept,
    with a warning.
    """
    value = environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", environ.get("NCCL_ASYNC_ERROR_HANDLING", "3"))
    if value in ("0", "2"):
        logger.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=%s: a hung NCCL collective will not end the process "
                       "(1 or 3 make --distributed-timeout-minutes stop it)", value)


def initialize_distributed(backend: Optional[str] = None, timeout_minutes: int = 30) -> None:
    """Initialises ``torch.distributed`` from the torchrun environment (or as a lone process).

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as set by torchrun
    (or by the training operator through torchrun). Without them, starts a world of one on a free port.
    Does nothing when already initialised.
    """
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ConfigError(f"torch.distributed needs {', '.join(missing)} in the environment (run under torchrun)")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        _check_nccl_error_handling(os.environ)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    logger.info("torch.distributed initialised: backend=%s world_size=%d", backend, dist.get_world_size())


def _tensor_parallel_options():
    """The TP groups' backend options: with NCCL, their collectives on a high-priority CUDA stream, so that a
    Domino chunk's all-reduce is scheduled ahead of the other chunk's GEMMs queued beside it; None (the
    backend's defaults) otherwise. torch 2.13 ``distributed_c10d._new_process_group_helper`` takes a
    ``ProcessGroupNCCL.Options`` as ``pg_options`` and otherwise builds one with ``is_high_priority_stream =
    False``; the group's ``timeout`` still overrides the options' own."""
    if dist.get_backend() != dist.Backend.NCCL:
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def initialize_model_parallel(tensor_model_parallel_size: int = 1, timeout_minutes: Optional[int] = None,
                              pipeline_model_parallel_size: int = 1) -> None:
    """Creates the TP, DP and (at pipeline size > 1) pipeline and embedding groups over the current world.

    ``timeout_minutes`` bounds every collective of these groups. It must be passed: ``dist.new_group``
    without a timeout takes torch's default (30 minutes for gloo, 10 for NCCL; torch 2.13
    ``distributed_c10d._new_group_with_tag`` -> ``_get_default_timeout``), not the world group's.

    Also reads ``DOMINO_SIMULATED_NETWORK`` (once, here) and emulates that link
    for the TP collectives (:mod:`domino.runtime.network_emulator`).

    Raises:
        ConfigError: when the world size is not divisible by TP x PP, or ``DOMINO_SIMULATED_NETWORK`` is malformed.
    """
    global _STATE
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    world = dist.get_world_size() if dist.is_initialized() else 1
    grid = RankGrid.build(world, tp, pp)
    link = install_from_environment()  # before any group exists, so bad values fail early
    if not dist.is_initialized():
        _STATE = _Groups(None, [0], None, [0], pp_ranks=[0], embedding_ranks=[0])
        return
    rank = dist.get_rank()
    timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes else None

    def mine(all_ranks: List[List[int]], options=None):
        # Every rank must create every group, in the same order (new_group is collective).
        found = None
        for ranks in all_ranks:
            group = dist.new_group(ranks, timeout=timeout, pg_options=options)
            if rank in ranks:
                found = (group, ranks)
        return found

    groups = _Groups(*mine(grid.tp, _tensor_parallel_options()), *mine(grid.dp), pp_ranks=[rank],
                     embedding_ranks=[rank], tp_link=link)
    if pp > 1:
        groups.pp_group, groups.pp_ranks = mine(grid.pp)
        embedding = mine(grid.embedding)  # None on a middle stage: it holds no copy of the embeddings
        groups.embedding_group, groups.embedding_ranks = embedding or (None, [])
    _STATE = groups


def launched_world_size() -> int:
    """The processes of this run: torch.distributed's world once initialised, else what the launcher
    (torchrun, the training operator) says in ``WORLD_SIZE``; 1 for a lone process."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def start(tensor_model_parallel_size: Optional[int] = None, *, backend: Optional[str] = None,
          timeout_minutes: int = ParallelConfig.distributed_timeout_minutes, lone_process_group: bool = False,
          pipeline_model_parallel_size: int = 1) -> None:
    """The start-up of every entry point (``domino pretrain`` through
    :func:`domino.train.engine.initialize_runtime`, evaluation through :mod:`domino.eval.runtime`): checks the
    layout, starts ``torch.distributed`` and creates the TP x PP x DP groups. Call it once per process.

    Args:
        tensor_model_parallel_size: The TP size (None: every process, evaluation's default).
        pipeline_model_parallel_size: The number of pipeline stages.
        backend: torch.distributed backend (None: nccl with CUDA, else gloo).
        timeout_minutes: Timeout of every collective of the world and of the groups.
        lone_process_group: Start torch.distributed for a lone process too (DeepSpeed needs a process group);
            otherwise a lone process runs without it.

    Raises:
        ConfigError: TP x PP does not divide the processes, or the launcher's environment is incomplete.
    """
    world = launched_world_size()
    tp, pp = tensor_model_parallel_size or world, pipeline_model_parallel_size
    check_tensor_parallel_size(world, tp, pp)  # before any process group exists
    if world > 1 or lone_process_group or dist.is_initialized():
        initialize_distributed(backend, timeout_minutes)
    initialize_model_parallel(tp, timeout_minutes=timeout_minutes, pipeline_model_parallel_size=pp)


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run."""
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forgets the groups (tests call this between configurations)."""
    global _STATE
    _STATE = None


def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """This rank's TP group (``None`` for a single process)."""
    return _STATE.tp_group if _STATE else None


def get_tensor_model_parallel_link() -> Optional[LinkEmulator]:
    """The emulated link of the TP collectives, or None (the default: real communication only)."""
    return _STATE.tp_link if _STATE else None


def link_for(group: Optional[dist.ProcessGroup]) -> Optional[LinkEmulator]:
    """The emulated link the collectives over ``group`` ride on: the TP group's, else None (the data-parallel
    collectives are DeepSpeed's and not emulated)."""
    return _STATE.tp_link if _STATE is not None and group is _STATE.tp_group else None


def set_tensor_model_parallel_link(link: Optional[LinkEmulator]) -> None:
    """Replaces the emulated TP link (None switches emulation off); for tests and benchmarks."""
    if _STATE is None:
        raise RuntimeError("initialize_model_parallel() must run before a TP link can be set")
    _STATE.tp_link = link


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in this rank's TP group."""
    return len(_STATE.tp_ranks) if _STATE else 1


def get_tensor_model_parallel_rank() -> int:
    """Position of this rank inside its TP group."""
    if not _STATE or not dist.is_initialized():
        return 0
    return _STATE.tp_ranks.index(dist.get_rank())


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 of this rank's group (the rank that reads data and broadcasts it)."""
    return _STATE.tp_ranks[0] if _STATE else 0


def get_data_parallel_group() -> Optional[dist.ProcessGroup]:
    """This rank's data-parallel group (``None`` for a single process)."""
    return _STATE.dp_group if _STATE else None


def get_data_parallel_world_size() -> int:
    """Number of data-parallel replicas."""
    return len(_STATE.dp_ranks) if _STATE else 1


def get_data_parallel_rank() -> int:
    """Index of this rank's replica among the data-parallel replicas."""
    if not _STATE or not dist.is_initialized():
        return 0
    return _STATE.dp_ranks.index(dist.get_rank())


def get_pipeline_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """This rank's pipeline group, stage 0 first (``None`` at pipeline size 1)."""
    return _STATE.pp_group if _STATE else None


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return len(_STATE.pp_ranks) if _STATE else 1


def get_pipeline_model_parallel_rank() -> int:
    """This rank's stage (0 = the one with the embeddings)."""
    if not _STATE or not dist.is_initialized():
        return 0
    return _STATE.pp_ranks.index(dist.get_rank())


def is_pipeline_first_stage() -> bool:
    """Whether this rank's stage holds the embeddings (always at pipeline size 1)."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    """Whether this rank's stage holds the final norm, the output layer and the loss (always at pipeline size 1)."""
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """The group of this pipeline's first and last stage when this rank is on one of them, else None (and None
    at pipeline size 1, where one stage holds the embedding and the output layer)."""
    if not _STATE or not dist.is_initialized() or dist.get_rank() not in _STATE.embedding_ranks:
        return None
    return _STATE.embedding_group


# DeepSpeed's ``mpu`` interface uses "model parallel" for what we call tensor parallel.
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_src_rank = get_tensor_model_parallel_src_rank
