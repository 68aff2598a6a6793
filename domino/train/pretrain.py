"""``pretrain(config, model_builder, dataset_builder, forward_step)``: the training loop.

Distributed initialisation, the optimizer (:mod:`domino.optim`: ZeRO data parallelism around tensor parallelism
with Domino), the learning-rate schedule, checkpoint save/resume, periodic evaluation and logging. The three
callables follow Megatron-LM's contracts, so a user can swap in their own model or data:

- ``model_builder(config, mesh) -> torch.nn.Module`` (``mesh``: the run's :class:`~domino.runtime.mesh.ParallelMesh`)
- ``dataset_builder((train, valid, test) sample counts) -> (train, valid, test)`` datasets
- ``forward_step(data_iterator, model) -> (output_tensor, loss_fn)`` where
  ``loss_fn(output_tensor) -> (loss, {"lm loss": data-parallel average})``
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch.distributed as dist

from domino.checkpoint.manager import CheckpointManager
from domino.config import DominoConfig, validate
from domino.goodput.ledger import AttemptOrigin, Ledger
from domino.parallel import random as tp_random
from domino.runtime import state
from domino.runtime.agreement import agree
from domino.runtime.mesh import ParallelMesh, collective_device
from domino.optim.build import build_optimizer
from domino.train import schedule_check
from domino.train.trainer import Trainer, TrainingDivergedError, TrainingResult

__all__ = ["pretrain", "TrainingDivergedError", "TrainingResult"]

logger = logging.getLogger(__name__)


def pretrain(config: DominoConfig, model_builder: Callable, dataset_builder: Callable, forward_step: Callable,
             padded_vocab_size: int, tokenizer=None, get_batch: Optional[Callable] = None, *,
             mesh: ParallelMesh, origin: Optional[AttemptOrigin] = None) -> TrainingResult:
    """Trains according to ``config`` (call it on every rank, after
    :func:`domino.train.runtime_start.initialize_runtime`).

    Args:
        config: the resolved run configuration.
        model_builder: ``model_builder(config, mesh)`` builds this rank's part of the (single-device-readable)
            model over the run's mesh.
        dataset_builder: builds train/valid/test datasets for the requested sample counts.
        forward_step: one micro-batch forward returning ``(output, loss_fn)``.
        padded_vocab_size: recorded in checkpoints so loading can check the shape.
        tokenizer: saved into every checkpoint when given.
        get_batch: one micro-batch's tensors by name from a data iterator; pipelined runs need it, as the pipeline
            schedule, not ``forward_step``, runs the stages (:mod:`domino.train.pipeline_step`).
        mesh: the run's layout, as ``initialize_runtime`` returned it: a value passed down from here, so nothing
            below reads a process-wide one.
        origin: where this attempt began, for the goodput ledger (default: this process's start; an in-process
            restart passes its failure's time and number).

    Raises:
        ConfigError: for settings that cannot work, before training starts.
        TrainingDivergedError: after ``--max-nan-steps`` consecutive non-finite losses.
    """
    if not state.model_parallel_is_initialized():
        raise RuntimeError("pretrain(): call domino.train.runtime_start.initialize_runtime(config) first, "
                           "once per process, and pass the mesh it returns")
    runtime_ready = time.time()
    # Each check ends in an agreement: a rank that fails stops every rank with the same one-line error.
    agree("checking the configuration", lambda: validate(config, world_size=dist.get_world_size(),
                                                         for_training=True))
    # Fail on a garbage --load before building anything.
    checkpoints = CheckpointManager.open(config, mesh)  # first of all: holds --save until the run ends
    optimizer = trainer = None
    try:
        schedule, config = agree("checking the schedules against the checkpoint",
                                 lambda: schedule_check.resumed_schedule(checkpoints.resume_from, config, mesh.dp.size,
                                                                         checkpoints.warm_start))
        # The checkpoint's vocabulary padding and ZeRO stage: from here on the run's config is the settled one.
        checkpoints, padded_vocab_size = checkpoints.fit(config, padded_vocab_size)
        config = checkpoints.config
        tp_random.model_parallel_seed(config.train.seed, mesh.tp.rank, mesh.cp.rank, mesh.tp.size)

        # Parameters created and initialised on their device, shard by shard.
        with collective_device(mesh.tp.process_group):
            model = model_builder(config, mesh)
        optimizer = build_optimizer(model, config, mesh)
        model_built = time.time()
        iteration, consumed = checkpoints.load(optimizer, padded_vocab_size)
        ledger = Ledger(config.checkpoint.save, enabled=dist.get_rank() == 0)
        ledger.start(origin or AttemptOrigin.new_process(), runtime_ready, model_built, time.time() - model_built, iteration)
        if origin is not None and origin.inprocess_restart and dist.get_rank() == 0:
            logger.warning("in-process restart %d resumed from iteration %d: %s", origin.inprocess_restart, iteration,
                           "the save in flight at the failure" if checkpoints.inflight == iteration else
                           "the newest checkpoint" if checkpoints.resume_from is not None else "no checkpoint yet")
        trainer = Trainer(config, mesh, checkpoints, optimizer, dataset_builder, forward_step, padded_vocab_size,
                          tokenizer, get_batch, schedule, ledger)
        return trainer.run(iteration, consumed, checkpoints.own_checkpoint(iteration))
    except BaseException as error:
        if trainer is not None and config.train.inprocess_restart and isinstance(error, Exception):
            try:
                trainer.saver.park()  # before the groups are left: the save in flight, for the restart to resume
            except Exception:  # noqa: BLE001  the failure being raised is the one to report; the restart falls back
                logger.exception("could not keep the save in flight for the in-process restart")
        # ZeRO's gradient hooks live in autograd's C++ side, so the cycle parameter -> hook -> optimizer -> parameter
        # (and the process groups on it) is never collected; destroy() removes them, so an in-process restart can
        # free the groups.
        if optimizer is not None:
            try:
                optimizer.destroy()
            except Exception:  # noqa: BLE001  the failure being raised is the one to report
                logger.exception("the optimizer's destroy() failed after a failed run")
        raise
    finally:
        checkpoints.close()  # --save is free for the next run (after the last save was committed)
