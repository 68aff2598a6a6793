"""In-process restart (``--inprocess-restart``, Megatron-LM's flag): a step that raises on any rank is survived
by the same processes.

Megatron-LM wraps its training function in nvidia-resiliency-ext's ``inprocess.Wrapper``
(``megatron/training/inprocess_restart.py``; the wrapper in ``src/nvidia_resiliency_ext/inprocess/wrap.py``): on
a fault every rank aborts its communicators, meets the others at a store barrier, and calls the training function
again, which resumes from the newest checkpoint. :func:`train_with_restarts` is that loop for ``domino pretrain``:

1. the rank whose step raised leaves its groups at once (:func:`domino.runtime.restart.leave`: destroyed, and
   freed; after its ``--async-save`` writer, if one is writing, has ended: step 2), which makes the peers
   blocked in a collective with it raise "Connection closed by peer" (reported as a
   :class:`~domino.runtime.agreement.PeerLostError`, without waiting: the leaving rank checked in as alive);
2. each peer leaves its groups in turn; every rank's trainer has closed its hang watch and SIGTERM group, ended
   its goodput attempt as failed, waited for its ``--async-save`` writer and kept that save
   (:mod:`domino.checkpoint.inflight`), and released ``--save`` on the way out of ``pretrain``;
3. all ranks meet on the first rendezvous's store (:func:`~domino.runtime.restart.meet`), form torch.distributed
   and the mesh again under a prefix of the generation (:func:`~domino.runtime.restart.generation_store`), and
   train again: ``pretrain`` commits the kept save when every rank's part of it was written, loads the newest
   checkpoint of ``--load`` (that save, then), logs which state it resumed, and starts a new goodput attempt.

Not restarted: failures every rank agreed on (:class:`~domino.config.ConfigError`, a bad flag or file: the same
again), a diverged loss, and a rank that does not come to the barrier within the distributed timeout (a dead
process: the launcher's restart takes over). At most :data:`MAX_INPROCESS_RESTARTS` restarts per process.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Callable, TypeVar

import torch.distributed as dist

from domino.config import ConfigError, DominoConfig
from domino.goodput.ledger import AttemptOrigin
from domino.optim import deepspeed_runtime
from domino.runtime import restart
from domino.runtime.agreement import PeerLostError
from domino.runtime.mesh import ParallelMesh
from domino.train.runtime_start import initialize_runtime
from domino.train.trainer import TrainingDivergedError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: In-process restarts one process makes before a failure ends it (and the launcher's policy decides).
MAX_INPROCESS_RESTARTS = 3


def restartable(error: BaseException) -> bool:
    """Whether an in-process restart can get past ``error`` (a lost peer, a failed step), unlike an agreed
    configuration error or a diverged loss, which a restart from the same checkpoint would meet again."""
    if isinstance(error, PeerLostError):
        return True
    return isinstance(error, Exception) and not isinstance(error, (ConfigError, TrainingDivergedError))


def train_with_restarts(config: DominoConfig, train: Callable[[ParallelMesh, AttemptOrigin], T]) -> T:
    """Starts the runtime and runs ``train(mesh, origin)``; with ``--inprocess-restart``, a restartable failure is
    followed by a new generation of process groups in the same process and ``train`` again, its ``origin`` the
    failure (the goodput ledger marks the attempt as an in-process restart; see the module docstring)."""
    mesh = initialize_runtime(config)
    origin = AttemptOrigin.new_process()
    if not config.train.inprocess_restart:
        return train(mesh, origin)
    store = restart.rendezvous_store()  # the first rendezvous's store: every generation meets on it
    world_size = dist.get_world_size()
    timeout = datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes)
    for generation in range(1, MAX_INPROCESS_RESTARTS + 2):
        try:
            return train(mesh, origin)
        except Exception as error:
            if generation > MAX_INPROCESS_RESTARTS or not restartable(error):
                raise
            failed_at = time.monotonic()
            origin = AttemptOrigin(time.time(), inprocess_restart=generation)
            logger.warning("in-process restart %d of %d after: %s: %s", generation, MAX_INPROCESS_RESTARTS,
                           type(error).__name__, " ".join(str(error).split())[:300])
        # Out of the except block: the traceback, which holds the failed try's frames (trainer, optimizer, model
        # and their groups), is gone, so leave() can drop the last reference to each group.
        mesh = None
        restart.leave(deepspeed_runtime.stop_comm)
        restart.meet(store, generation, world_size, timeout)
        mesh = initialize_runtime(config, store=restart.generation_store(store, generation))
        logger.warning("in-process restart %d: process groups formed again in %.2f s (pid %d)", generation,
                       time.monotonic() - failed_at, os.getpid())
    raise AssertionError("unreachable")
