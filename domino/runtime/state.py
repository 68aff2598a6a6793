"""Process start-up (``torch.distributed`` from the launcher's environment, the groups of the layout) and the shim.

:func:`start` builds the run's :class:`~domino.runtime.mesh.ParallelMesh` once and returns it; code below the entry
points receives that value (or one of its groups) as an argument. The getters at the end answer from the mesh
:func:`start` built, for the entry points and tests (DeepSpeed gets the mesh itself behind its ``mpu`` interface,
:mod:`domino.optim.deepspeed_mpu`). When nothing is initialised every getter answers as a single process (rank 0,
size 1, group ``None``).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from domino.config import ConfigError, ParallelConfig
from domino.config.validate import check_tensor_parallel_size
from domino.runtime.mesh import ParallelMesh, RankGrid, collective_device  # noqa: F401  (imported from here too)
from domino.runtime.network_emulator import LinkEmulator

logger = logging.getLogger(__name__)


_MESH: Optional[ParallelMesh] = None  # the entry points' mesh, for the shim getters below



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _check_nccl_error_handling(environ) -> None:
    """Makes a failed or timed-out NCCL collective end the process instead of hanging it.

    torch's NCCL watchdog reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (legacy ``NCCL_ASYNC_ERROR_HANDLING``):
    3 (SkipCleanUp, torch's default) and 1 (TearDown) tear the process down once a collective exceeds the
    group's timeout; 0 (NoHandling) and 2 (CleanUpOnly) leave it running (torch 2.13
    ``csrc/distributed/c10d/ProcessGroupNCCL.hpp``, ``ErrorHandlingMode``). An explicit 0 or 2 is kept,
    with a warning.

    The watchdog's own timeout is the collective's (``--distributed-timeout-minutes``); ``--hang-timeout-s`` names
    the hung rank before it (:mod:`domino.runtime.hang_watch`, which dumps the flight recorder itself). Where the
    watchdog is what fires (a hang in a save or an evaluation, or the watch off), ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``
    makes it write the flight recorder's record of the collectives in flight first (to ``TORCH_FR_DUMP_TEMP_FILE``,
    ``/tmp/nccl_trace_rank_`` by default), as torchtitan's ``init_distributed`` sets it
    (``torchtitan/distributed/utils.py``); the recorder keeps ``TORCH_FR_BUFFER_SIZE`` entries (2000 by default,
    ``FlightRecorder.hpp``) and dumps only in modes 3 and 1 (pytorch issue #121055). Both are read when the NCCL
    group is made (torch's "ProcessGroupNCCL Environment Variables" page). Untested here: no NCCL on CPU.
    """
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    value = environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", environ.get("NCCL_ASYNC_ERROR_HANDLING", "3"))
    if value in ("0", "2"):
        logger.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=%s: a hung NCCL collective will not end the process "
                       "(1 or 3 make --distributed-timeout-minutes stop it)", value)


#: torchrun's switch that makes each rendezvous round's rank 0 host a new TCPStore instead of the agent's shared one.
UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _int(environ, name: str) -> int:
    try:
        return int(environ.get(name, "0"))
    except ValueError:
        return 0


def restarted_round_store(environ, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """The store of a round that torchrun restarted on its agent's shared store: the same server, under a prefix of
    the round; None in a first round or where each round has a store of its own.

    torchrun (torch 2.13) hands its workers a TCPStore that its agent keeps for the whole job
    (``TORCHELASTIC_USE_AGENT_STORE=True``: always with ``--master-addr/--master-port``, ``static_tcp_rendezvous.py``;
    by default with ``--standalone`` or ``--rdzv-backend c10d``, ``dynamic_rendezvous.py`` creating the shared server
    once per agent in ``_bootstrap_store_info``), and ``init_process_group`` writes the same key names in every
    round (``distributed_c10d.py``: ``PrefixStore("default_pg", store)``). After ``--max-restarts`` restarts the
    workers, a new rank reads its peers' addresses of the round before: gloo's connect is refused or waits
    forever, NCCL takes the old unique id (pytorch issues #135712 and #167288). ``TORCHELASTIC_RESTART_COUNT``
    names the round; every worker of one torchrun agent has the same count (``local_elastic_agent.py``).
    """
    restart = _int(environ, "TORCHELASTIC_RESTART_COUNT")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart <= 0:
        return None
    client = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"domino/torchrun-round-{restart}", client)


def check_worker_restarts(environ) -> Optional[str]:
    """The line that says, before any work, that torchrun's worker restarts may not form the groups again; or None.

    Across nodes the restart counts of :func:`restarted_round_store` need not agree: an agent that restarts its
    workers because another node's failed does not count it (torch 2.13 ``elastic/agent/server/api.py``,
    ``_invoke_run``). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment gives each round of a c10d
    rendezvous a store of its own, hosted by its rank 0 (``dynamic_rendezvous.py``); the static rendezvous of
    ``--master-addr`` restarts only the failed node's workers, which a multi-node job cannot survive either way.
    """
    max_restarts, nodes = _int(environ, "TORCHELASTIC_MAX_RESTARTS"), _int(environ, "GROUP_WORLD_SIZE")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or max_restarts <= 0 or nodes <= 1:
        return None
    return (f"torchrun --max-restarts {max_restarts} on {nodes} nodes shares its agent's TCPStore with the ranks: "
            f"a worker restart may read another round's rendezvous keys and never connect (pytorch #135712, "
            f"#167288); with --rdzv-backend c10d set {UNSHARED_STORE_ENV}=1 in torchrun's environment")


def initialize_distributed(backend: Optional[str] = None, timeout_minutes: int = 30,
                           store: Optional[dist.Store] = None) -> None:
    """Initialises ``torch.distributed`` from the torchrun environment (or as a lone process).

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` as set by torchrun
    (or by the training operator through torchrun). Without them, starts a world of one on a free port.
    ``store``: rendezvous on this store instead of ``MASTER_ADDR:MASTER_PORT`` (an in-process restart forms
    its groups again on the first rendezvous's store, :mod:`domino.runtime.restart`).
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
    restarts_line = check_worker_restarts(os.environ)
    if restarts_line and os.environ["RANK"] == "0":
        logger.warning("%s", restarts_line)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = store or restarted_round_store(os.environ, timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
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
                              pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
                              link: Optional[LinkEmulator] = None) -> ParallelMesh:
    """Creates the TP, DP and (at pipeline size > 1) pipeline and embedding groups over the current world and
    returns them as the run's :class:`ParallelMesh` (which the getters below also answer from).

    ``timeout_minutes`` bounds every collective of these groups. It must be passed: ``dist.new_group``
    without a timeout takes torch's default (30 minutes for gloo, 10 for NCCL; torch 2.13
    ``distributed_c10d._new_group_with_tag`` -> ``_get_default_timeout``), not the world group's.

    ``link``: the emulated interconnect of the TP collectives (:mod:`domino.runtime.network_emulator`), which
    the entry point reads from ``DOMINO_SIMULATED_NETWORK`` once; None: the real links only.

    Raises:
        ConfigError: when the world size is not divisible by TP x PP.
    """
    global _MESH
    options = _tensor_parallel_options() if dist.is_initialized() else None
    _MESH = ParallelMesh.build(tensor_model_parallel_size, pipeline_model_parallel_size, timeout_minutes, link,
                               options, context_parallel_size)
    return _MESH


def launched_world_size() -> int:
    """The processes of this run: torch.distributed's world once initialised, else what the launcher
    (torchrun, the training operator) says in ``WORLD_SIZE``; 1 for a lone process."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def start(tensor_model_parallel_size: Optional[int] = None, *, backend: Optional[str] = None,
          timeout_minutes: int = ParallelConfig.distributed_timeout_minutes, lone_process_group: bool = False,
          pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
          store: Optional[dist.Store] = None, link: Optional[LinkEmulator] = None) -> ParallelMesh:
    """The start-up of every entry point (``domino pretrain`` through
    :func:`domino.train.runtime_start.initialize_runtime`, evaluation through :mod:`domino.eval.runtime`): checks the
    layout, starts ``torch.distributed`` and creates the TP x PP x DP groups. Call it once per process.

    Args:
        tensor_model_parallel_size: The TP size (None: every process, evaluation's default).
        pipeline_model_parallel_size: The number of pipeline stages.
        context_parallel_size: The ranks that split each sequence.
        backend: torch.distributed backend (None: nccl with CUDA, else gloo).
        timeout_minutes: Timeout of every collective of the world and of the groups.
        lone_process_group: Start torch.distributed for a lone process too (DeepSpeed needs a process group);
            otherwise a lone process runs without it.
        store: The rendezvous store to start on (an in-process restart's; default: the launcher's environment).
        link: The emulated link of the TP collectives (``DOMINO_SIMULATED_NETWORK``, read by the entry point:
            :func:`domino.runtime.network_emulator.link_from_environment`); None: the real links only.

    Returns:
        The run's mesh, to pass down.

    Raises:
        ConfigError: TP x PP does not divide the processes, or the launcher's environment is incomplete.
    """
    world = launched_world_size()
    tp, pp, cp = tensor_model_parallel_size or world, pipeline_model_parallel_size, context_parallel_size
    check_tensor_parallel_size(world, tp, pp, cp)  # before any process group exists
    if world > 1 or lone_process_group or dist.is_initialized():
        initialize_distributed(backend, timeout_minutes, store)
    return initialize_model_parallel(tp, timeout_minutes=timeout_minutes, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, link=link)


# Built once: every caller before start() gets the same value, with the same groups and their comm timers.
_SINGLE_MESH = ParallelMesh.single()


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run."""
    return _MESH is not None


def destroy_model_parallel() -> None:
    """Forgets the groups (tests call this between configurations)."""
    global _MESH
    _MESH = None


def current_mesh() -> ParallelMesh:
    """The mesh :func:`start` built (the single-process mesh before): for entry points, which pass it down."""
    return _MESH if _MESH is not None else _SINGLE_MESH


# ---- the shim: the mesh's fields as getters, for the entry points and tests -------------------------------------

def get_tensor_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """This rank's TP group (``None`` for a single process)."""
    return current_mesh().tp.process_group


def set_tensor_model_parallel_link(link: Optional[LinkEmulator]) -> None:
    """Replaces the emulated TP link of the mesh (None switches emulation off), for tests: models built afterwards
    over ``current_mesh().tp`` ride it; those built before keep the group they were given."""
    global _MESH
    if _MESH is None:
        raise RuntimeError("initialize_model_parallel() must run before a TP link can be set")
    _MESH = _MESH.with_tp_link(link)


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in this rank's TP group."""
    return current_mesh().tp.size


def get_tensor_model_parallel_rank() -> int:
    """Position of this rank inside its TP group."""
    return current_mesh().tp.rank


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 of this rank's group (the rank that reads data and broadcasts it)."""
    return current_mesh().tp.first_rank


def get_data_parallel_group() -> Optional[dist.ProcessGroup]:
    """This rank's data-parallel group (``None`` for a single process)."""
    return current_mesh().dp.process_group


def get_data_parallel_world_size() -> int:
    """Number of data-parallel replicas."""
    return current_mesh().dp.size


def get_data_parallel_rank() -> int:
    """Index of this rank's replica among the data-parallel replicas."""
    return current_mesh().dp.rank


def get_pipeline_model_parallel_group() -> Optional[dist.ProcessGroup]:
    """This rank's pipeline group, stage 0 first (``None`` at pipeline size 1)."""
    return current_mesh().pp.process_group


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    return current_mesh().pp.size


def get_pipeline_model_parallel_rank() -> int:
    """This rank's stage (0 = the one with the embeddings)."""
    return current_mesh().pp.rank


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """The group of this pipeline's first and last stage when this rank is on one of them, else None (and None
    at pipeline size 1, where one stage holds the embedding and the output layer)."""
    embedding = current_mesh().embedding
    return embedding.process_group if embedding is not None else None
