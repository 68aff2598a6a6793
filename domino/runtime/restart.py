"""Leaving and forming the process groups again inside a living process: the runtime half of an in-process restart
(``--inprocess-restart``; the loop is :mod:`domino.train.inprocess`).

The design follows nvidia-resiliency-ext's in-process restart (``src/nvidia_resiliency_ext/inprocess/``: its
``abort.py`` ``AbortTorchDistributed`` shuts down every group's backend from a monitor thread, then destroys the
groups; the wrapper then meets the other ranks at a store barrier and calls the training function again), without
its monitor thread and process: here the rank whose step raised tears its groups down itself, and that is what
wakes the others.

* :func:`leave` checks this rank in as alive (:func:`domino.runtime.agreement.check_in`, so a peer's lost-peer
  report does not wait for it) and destroys every group once nothing else refers to them: the gloo backend closes
  its connections when the group object itself goes, so a peer blocked in a collective with this rank raises at
  once ("Connection closed by peer", gloo's ``transport/tcp/pair.cc`` in torch 2.13) instead of waiting for the
  group's timeout. ``destroy_process_group`` while the failed try's traceback still held the groups, without
  the ``gc.collect()`` that frees the engine's reference cycles, or with ZeRO's gradient hooks left in place
  (:func:`domino.train.pretrain.pretrain` calls the optimizer's ``destroy()`` on a failure) left the peer
  waiting the whole timeout in our runs (tests/train/test_inprocess_restart.py fails each way); ``ProcessGroup.abort()`` on a gloo group followed
  by its destruction ended the process with SIGABRT, so nvidia-resiliency-ext's abort step is not taken here (on
  NCCL it is ``ncclCommAbort``; this path is tested on gloo only).
* :func:`meet` is the barrier every rank passes before the next generation's groups are formed, on the first
  rendezvous's store (kept by the caller: with torchrun the agent hosts it; without, rank 0's process does).
* :func:`generation_store` is the store of generation ``g``: a prefix of its own over that store, so the new
  groups' rendezvous keys (torch names groups from a counter that ``destroy_process_group`` resets) never meet
  the old ones.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from typing import Callable

import torch.distributed as dist

from domino.runtime import state
from domino.runtime.agreement import check_in

logger = logging.getLogger(__name__)


def rendezvous_store() -> dist.Store:
    """The default group's store (torch 2.13 ``distributed_c10d._get_default_store``, no public accessor): keep it
    before :func:`leave`, which forgets the groups that hold it."""
    return dist.distributed_c10d._get_default_store()


def _prefix(generation: int) -> str:
    # torchrun's restarted rounds may share one store (domino.runtime.state.restarted_round_store): keep them apart.
    return f"domino/inprocess/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{generation}"


def leave(destroy_groups: Callable[[], None] = dist.destroy_process_group) -> None:
    """Destroys every process group of this process and forgets the mesh (no collective: peers blocked with this
    rank raise instead). Call it with no reference to a group left (the failed try's frames gone); safe to call
    when the groups are already gone.

    Args:
        destroy_groups: destroys the default group and every other (a training run passes DeepSpeed's, which
            also drops DeepSpeed's own references to them: :func:`domino.optim.deepspeed_runtime.stop_comm`).
    """
    state.destroy_model_parallel()
    if dist.is_initialized():
        try:
            check_in()
        except Exception as error:  # noqa: BLE001  the store is unreachable: the peers find that out themselves
            logger.debug("in-process restart: could not check in: %s", error)
        destroy_groups()
    gc.collect()  # the failed try's optimizer and model sit in reference cycles: their groups go with them now


def meet(store: dist.Store, generation: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Waits until every rank has left its groups for ``generation`` (raises after ``timeout``: a rank that never
    comes, a dead process, ends the job and leaves the restart to the launcher)."""
    prefix = _prefix(generation)
    if store.add(f"{prefix}/arrived", 1) == world_size:
        store.set(f"{prefix}/ready", "1")
    store.wait([f"{prefix}/ready"], timeout)


def generation_store(store: dist.Store, generation: int) -> dist.Store:
    """The store generation ``generation``'s groups are formed on."""
    return dist.PrefixStore(f"{_prefix(generation)}/groups", store)
