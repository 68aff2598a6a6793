"""A run's checkpoints as one value: what it resumes, loading that, saving, and which checkpoint is its own.

The training loop asks one object instead of calling the discovery, resume and save modules itself:

1. :meth:`CheckpointManager.open` takes ``--save`` for this run (:mod:`domino.checkpoint.save_root`: one writer per
   save root, a predecessor still saving waited for), commits an in-process restart's save in flight at the
   failure where every rank's part of it was written (:mod:`domino.checkpoint.inflight`), and then decides, on
   every rank together, what the run starts from (its own checkpoint under ``--save`` first, else ``--load``,
   else an older intact one when the newest is damaged: :func:`domino.checkpoint.discovery.find_checkpoint`)
   and checks that checkpoint against the run
   (:func:`domino.checkpoint.resume.check_resumable`), before anything is built;
2. :meth:`fit` settles what the model is built with (the checkpoint's padded vocabulary, its ZeRO stage);
3. :meth:`load` restores the built model and optimizer (weights, optimizer state, RNG) and returns where to continue;
4. :meth:`saver` writes checkpoints on the run's mesh (synchronously or with ``--async-save``), and
   :meth:`own_checkpoint` names the checkpoint of the resumed iteration, which the loop does not write again;
5. :meth:`close` releases ``--save`` at the end of the run (the kernel does, should the process die first).

Megatron-LM's training loop reaches the same steps through ``load_checkpoint`` / ``save_checkpoint`` in
``megatron/training/checkpointing.py`` (NVIDIA/Megatron-LM 699abf1); torchtitan keeps them in one
``CheckpointManager`` (``torchtitan/components/checkpoint.py``, pytorch/torchtitan 0128b99: ``save``, ``load``,
its async modes), as here.
"""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

from domino.checkpoint import async_save, discovery, inflight, resume, save_root
from domino.checkpoint.on_disk import Checkpoint
from domino.checkpoint.save_root import SaveRootLock
from domino.config import DominoConfig
from domino.runtime.agreement import agree
from domino.runtime.mesh import ParallelMesh

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointManager:
    """The checkpoints of one run on one mesh (see the module docstring).

    Attributes:
        config: the run's configuration (``--save``, ``--load``, ``--finetune``, ``--async-save``, ...).
        mesh: the run's parallel layout: which slices this rank reads and writes.
        resume_from: the checkpoint the run starts from, or None for a fresh start.
        warm_start: take only ``resume_from``'s weights (``--finetune``), starting at iteration 0.
        writer: this run's writer token, naming its temporary directories under ``--save``.
        root_lock: rank 0's lock on ``--save`` (None on other ranks and without ``--save``).
        inflight: the iteration of the save in flight at an in-process restart's failure, committed by
            :meth:`open` (None when there was none, or not every rank held it complete).
    """

    config: DominoConfig
    mesh: ParallelMesh
    resume_from: Optional[Checkpoint] = None
    warm_start: bool = False
    writer: str = ""
    root_lock: Optional[SaveRootLock] = None
    inflight: Optional[int] = None

    @classmethod
    def open(cls, config: DominoConfig, mesh: ParallelMesh) -> "CheckpointManager":
        """Decides what the run resumes and checks it against the run (collective: each step ends in an agreement,
        so a rank that fails stops every rank with the same one-line error, before anything is built). ``--save``
        is taken first: a predecessor finishing its last save commits it before this run chooses."""
        c = config.checkpoint
        keeps = config.train.inprocess_restart and c.async_save and bool(c.save)  # the same on every rank
        writer, root_lock = save_root.hold(config, inflight.parked_writer(config) if keeps else None)
        try:
            # Before choosing: a save every rank kept complete is committed, and so the newest checkpoint.
            kept = inflight.settle(config) if keeps else None
            resume_from, warm_start = agree("choosing the checkpoint to resume",
                                            lambda: discovery.find_checkpoint(config))
            agree("checking the checkpoint against this run", lambda: resume.check_resumable(
                resume_from, config, mesh.dp.size, warm_start))
        except BaseException:
            if root_lock is not None:
                root_lock.release()
            raise
        return cls(config, mesh, resume_from, warm_start, writer, root_lock, kept)

    def fit(self, config: DominoConfig, padded_vocab_size: int) -> Tuple["CheckpointManager", int]:
        """This manager over ``config`` (the run's, as settled so far) with what the resume takes settled into it,
        the ZeRO stage and the vocabulary padding, and the padded vocabulary the model is built with (the
        checkpoint's, where it differs: :func:`domino.checkpoint.resume.fit_run_to`)."""
        config, padded = resume.fit_run_to(self.resume_from, config, padded_vocab_size, self.warm_start,
                                           self.mesh.dp.size)
        return dataclasses.replace(self, config=config), padded

    def load(self, optimizer, padded_vocab_size: int) -> Tuple[int, int]:
        """Restores ``optimizer`` (and its model) from :attr:`resume_from` (collective); ``(iteration, consumed samples)`` to continue
        from, ``(0, 0)`` for a fresh start or a warm start."""
        if self.resume_from is None:
            if self.config.checkpoint.load:
                logger.info("--load %s holds no checkpoint yet: starting from scratch", self.config.checkpoint.load)
            return 0, 0
        return resume.load_checkpoint(optimizer, self.config, self.mesh, self.resume_from, padded_vocab_size,
                                      weights_only=self.warm_start)

    def own_checkpoint(self, iteration: int) -> Optional[str]:
        """The checkpoint of ``iteration`` under ``--save`` the run resumed, if any (not written again)."""
        return discovery.own_checkpoint(self.config, self.resume_from, self.warm_start, iteration)

    def saver(self) -> async_save.CheckpointSaver:
        """The saver ``--async-save`` asks for, on the run's mesh (collective: the asynchronous one creates
        process groups)."""
        return async_save.make_saver(self.config, self.mesh, self.writer)

    def close(self) -> None:
        """Releases ``--save`` (rank 0; after the last save is committed, or when the run failed)."""
        if self.root_lock is not None:
            self.root_lock.release()
