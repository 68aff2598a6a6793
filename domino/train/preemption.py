"""``--exit-signal-handler``: SIGTERM on any rank stops every rank at the next step boundary, after a save.

Megatron-LM checks its signal handler every iteration (``megatron/training/training.py`` ``train``: ``if
args.exit_signal_handler: signal_handler = get_signal_handler(); if any(signal_handler.signals_received())``,
an all-gather of the flag on the training group each step). Here the flag travels on a gloo group of its own,
on the host, launched asynchronously at one step boundary and read at the next: the training thread never waits
for the device, and by the time it is read the all-reduce of a few bytes has long finished. Every rank launches
and reads the same flags in the same order, so every rank stops at the same iteration: the one after the signal
reached any rank (one step of lag, for no stall).

The time left after SIGTERM: in a launched job, the pod's grace period, since the signal relay
(:mod:`domino.launch.signal_relay`, the container's first process) hands the signal to the ranks past torchrun and
exports the period as ``DOMINO_GRACE_PERIOD_S``. A torchrun that receives SIGTERM itself (started by hand, or by
``--command``) forwards it and SIGKILLs the ranks ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds later (the launcher
derives it from the grace period, :func:`domino.launch.defaults.shutdown_timeout_s`); torch reads that variable
only since pytorch/pytorch#172596 (merged 2026-03; torch 2.13 ``distributed/launcher/api.py``
``LaunchConfig.shutdown_timeout``), and an older torchrun kills after a fixed 30 s whatever the variable says,
which :func:`startup_warnings` reports.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from datetime import timedelta
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from domino.config import DominoConfig
from domino.launch.signal_relay import GRACE_PERIOD_ENV

logger = logging.getLogger(__name__)

#: torchrun's SIGTERM-to-SIGKILL wait where it is not configurable, or not configured (seconds).
TORCHRUN_DEFAULT_SHUTDOWN_S = 30
#: The variable torchrun reads its shutdown timeout from (torch ``distributed/launcher/api.py``).
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: The write rate assumed for the start-up estimate of a save (bytes/s per rank, to a shared volume): a
#: deliberately modest figure; every save's measured time is checked against the grace period too.
ASSUMED_WRITE_BYTES_PER_S = 500e6
#: Bytes a save writes per parameter beyond the weights: fp32 master copy and Adam's two moments.
OPTIMIZER_BYTES_PER_PARAM = 12


def torchrun_honours_shutdown_timeout() -> bool:
    """Whether this torch's torchrun reads ``--shutdown-timeout`` / ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``."""
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker (torchrun's agent sets ``TORCHELASTIC_RUN_ID``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def under_signal_relay() -> bool:
    """Whether the signal relay started this process's torchrun (it exports the grace period)."""
    return GRACE_PERIOD_ENV in os.environ


def grace_period_s() -> Optional[float]:
    """Seconds between SIGTERM and the SIGKILL that follows it, when known: the pod's grace period under the signal
    relay, else torchrun's shutdown timeout."""
    if under_signal_relay():
        return float(os.environ[GRACE_PERIOD_ENV])
    if not under_torchrun():
        return None
    if not torchrun_honours_shutdown_timeout():
        return float(TORCHRUN_DEFAULT_SHUTDOWN_S)
    return float(os.environ.get(SHUTDOWN_TIMEOUT_ENV, TORCHRUN_DEFAULT_SHUTDOWN_S))


def estimated_save_s(optimizer) -> float:
    """A rough time for one rank's save: its parameters' bytes plus optimizer state, at the assumed rate."""
    params = [p for p in optimizer.module.parameters()]
    size = sum(p.numel() * (p.element_size() + OPTIMIZER_BYTES_PER_PARAM) for p in params)
    return size / ASSUMED_WRITE_BYTES_PER_S


def startup_warnings(config: DominoConfig, optimizer) -> List[str]:
    """The one-line warnings for a run that a SIGTERM could cost its progress (logged by rank 0)."""
    out = []
    wanted = os.environ.get(SHUTDOWN_TIMEOUT_ENV)
    if under_torchrun() and not under_signal_relay() and not torchrun_honours_shutdown_timeout() and wanted and \
            float(wanted) > TORCHRUN_DEFAULT_SHUTDOWN_S:
        out.append(f"torch {torch.__version__}: torchrun ignores {SHUTDOWN_TIMEOUT_ENV}={wanted} and kills the ranks "
                   f"{TORCHRUN_DEFAULT_SHUTDOWN_S} s after SIGTERM (the setting needs a torch with "
                   "pytorch/pytorch#172596): a save after SIGTERM must fit in 30 s")
    grace = grace_period_s()
    if config.train.exit_signal_handler and config.checkpoint.save and grace is not None:
        estimate = estimated_save_s(optimizer)
        if estimate > grace:
            out.append(f"--exit-signal-handler: a save is estimated at {estimate:.0f} s (at "
                       f"{ASSUMED_WRITE_BYTES_PER_S / 1e6:.0f} MB/s), longer than the {grace:.0f} s left after "
                       f"SIGTERM ({GRACE_PERIOD_ENV if under_signal_relay() else SHUTDOWN_TIMEOUT_ENV}): raise the "
                       "grace period or save periodically")
    return out


class StopSignal:
    """SIGTERM caught on this rank, and the agreement of every rank on it at each step boundary."""

    def __init__(self, enabled: bool, timeout_minutes: float) -> None:
        self.enabled = enabled
        self.received_at: Optional[float] = None  # time.monotonic() of this rank's SIGTERM
        self.agreed_at: Optional[float] = None  # when this rank learned that some rank had one
        self._previous = None
        self._group = None
        self._flag: Optional[torch.Tensor] = None
        self._value = np.zeros(1, dtype=np.int32)  # the flag's memory: read as an array, not a tensor read
        self._work = None
        if not enabled:
            return
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A host-side group of its own (new_group is collective: every rank builds the trainer, in order),
            # so the flag never waits behind the training's or a save's collectives.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()  # acted on at a step boundary; the handler only records it

    def requested(self) -> bool:
        """Called once per step boundary on every rank: whether every rank is to stop here (all agree)."""
        if not self.enabled:
            return False
        if self._group is None:
            stop = self.received_at is not None
        else:
            stop = False
            if self._work is not None:
                self._work.wait()  # wait: the flag launched at the previous step boundary (gloo, on the host)
                stop = bool(self._value[0])
            if not stop:
                self._value = np.array([0 if self.received_at is None else 1], dtype=np.int32)
                self._flag = torch.from_numpy(self._value)  # shares the array's memory
                # Launch: any rank's SIGTERM, max-reduced; waited for at the next step boundary.
                self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            else:
                self._work = None
        if stop and self.agreed_at is None:
            self.agreed_at = time.monotonic()
        return stop

    def since_signal_s(self) -> float:
        """Seconds since this rank's SIGTERM (or, on a rank without one, since it learned of another's)."""
        start = self.received_at if self.received_at is not None else self.agreed_at
        return time.monotonic() - start if start is not None else 0.0

    def close(self, wait: bool = True) -> None:
        """Restores the previous handler; with ``wait`` (a run that ends normally) first waits for the flag still
        in flight, so no collective is left on the group (a failing run does not: a lost peer never answers)."""
        if self._work is not None and wait:
            self._work.wait()  # wait: the last flag launched
        self._work = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
