"""``--hang-timeout-s``: a rank that stops making progress is named within the timeout, not after the collective's.

A stopped rank (``kill -STOP``, a wedged NCCL call, a GPU in a bad state, a stuck network filesystem read) holds its
peers in their next collective until the process group's timeout (``--distributed-timeout-minutes``, 10 by
default), and the error that ends the job names no rank. Megatron's fault tolerance does better with rank monitors
and heartbeats (NVIDIA ``nvidia-resiliency-ext``, ``fault_tolerance/rank_monitor_server.py``: a heartbeat from each
rank, a timeout per phase); this is the same idea on what every domino run already has, the rendezvous store.

Every rank runs a daemon thread that the training thread cannot block (the training thread only sets two
attributes, :meth:`HangWatch.progress`; Python threads run while another waits in a collective, which releases
the GIL). Every ``beat`` seconds the thread writes the rank's heartbeat to the store (``domino/heartbeat/<rank>``:
wall time, iteration, phase, host, pid, when the rank last made progress) and reads everyone's. When this rank has
made no progress for the timeout, it looks for the rank that holds it:

* a rank whose heartbeat stopped: its process does not run at all (stopped, frozen, its node gone);
* else the ranks whose iteration is behind the others': they never reached the collective the others wait in
  (a wedged device call, a stuck read);
* else none can be told apart (all wait in the same collective: a network fault), which is said too.

It then logs one line naming the rank (host, pid, last iteration, phase), dumps its own Python stacks
(``faulthandler``) and torch's flight recorder of the collectives in flight where it has one
(``torch._C._distributed_c10d._dump_fr_trace_json``; NCCL's recorder keeps ``TORCH_FR_BUFFER_SIZE`` or
``TORCH_NCCL_TRACE_BUFFER_SIZE`` entries, 2000 by default in torch 2.13, ``csrc/distributed/c10d/FlightRecorder.hpp``),
and ends the process with
:data:`HANG_EXIT_CODE`: 142, 128 + SIGALRM, "a timer expired", in the range the training operator's ``ExitCode``
restart policy retries (128-255; docs/cluster.md, "Restarts"). The first rank to exit makes torchrun stop the rest.

The timeout covers the loop's steps (and the short work between them); a save or an evaluation may take longer than
any step, so during those the watch waits ``--distributed-timeout-minutes`` instead, as torch does.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from domino.runtime.comm_timing import CommTimer

logger = logging.getLogger(__name__)

#: The exit status of a rank that found a hung peer: 128 + SIGALRM (14), retryable under ``ExitCode``.
HANG_EXIT_CODE = 142
#: Where each rank's heartbeat lives in the rendezvous store.
KEY = "domino/heartbeat/{restart}/{rank}"
#: The phases in which a rank is expected to finish within the step timeout.
STEP_PHASES = ("step",)
#: The default timeout: this many times the slowest of the recent steps, and at least AUTO_FLOOR_S.
AUTO_STEPS, AUTO_FLOOR_S = 10, 180.0


class HangWatch:
    """This rank's heartbeat and its watch over the others (a no-op at world size 1 or with ``timeout_s`` 0).

    Args:
        timeout_s: seconds without progress in a step after which the rank holding this one is named (0: off;
            None: :data:`AUTO_STEPS` times the slowest of the last 20 steps, at least :data:`AUTO_FLOOR_S`).
        long_phase_timeout_s: the same for other phases (the first step, saves, evaluation).
        on_hang: called with the report line before the process exits (the goodput ledger's last record).
        store: the rendezvous store (default: the default group's).
        timers: the mesh groups' comm timers by name (``{"tp": ..., "cp": ...}``): the last collective each rank
            entered goes into its heartbeat, and a stalled rank dumps its collectives in flight.
    """

    def __init__(self, timeout_s: Optional[float], long_phase_timeout_s: float,
                 on_hang: Optional[Callable[[str], None]] = None, store=None,
                 timers: Optional[Dict[str, CommTimer]] = None) -> None:
        self.fixed_timeout_s, self.long_phase_timeout_s = timeout_s, long_phase_timeout_s
        self.on_hang = on_hang
        self.timers = timers or {}
        self.iteration, self.phase = 0, "first step"
        self.progressed_at = time.time()
        self.recent_steps: List[float] = []  # seconds, the last 20 steps
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if timeout_s == 0 or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        # torch.distributed keeps the default group's rendezvous store here (torch 2.13 distributed_c10d.py
        # ``_get_default_store``); there is no public accessor (domino.runtime.agreement reads it the same way).
        self.store = store or dist.distributed_c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.beat_s = max(0.1, min(1.0, self.timeout_s / 5))
        self.silent_s = max(2.0, 5 * self.beat_s)  # five missed heartbeats: the process does not run
        self._beat()  # the first one before training starts: a rank stopped in its first steps has one too
        self._thread = threading.Thread(target=self._watch, name="domino-hang-watch", daemon=True)
        self._thread.start()

    @property
    def timeout_s(self) -> float:
        """The step timeout now: fixed, or derived from the recent steps, and then at most half the collective
        timeout, so that the watch names the hung rank before torch's timeout ends the run naming none."""
        if self.fixed_timeout_s is not None:
            return self.fixed_timeout_s
        derived = max(AUTO_FLOOR_S, AUTO_STEPS * max(self.recent_steps, default=0.0))
        return min(derived, self.long_phase_timeout_s / 2)

    def progress(self, iteration: int, phase: str = "step") -> None:
        """Called by the training thread at each step boundary and phase change (sets attributes only)."""
        if iteration == self.iteration and phase == self.phase:
            return
        now = time.time()
        if phase == self.phase == "step" and iteration == self.iteration + 1:
            self.recent_steps = [*self.recent_steps[-19:], now - self.progressed_at]
        self.iteration, self.phase, self.progressed_at = iteration, phase, now

    def close(self) -> None:
        """Stops the watch (the end of training, or a failure that ends the run anyway)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        self.store.set(KEY.format(restart=self.restart, rank=self.rank), json.dumps({
            "t": time.time(), "iteration": self.iteration, "phase": self.phase, "host": self.host, "pid": self.pid,
            "progressed_at": self.progressed_at, "collective": last_collective(self.timers)}))

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._beat()
                stalled = time.time() - self.progressed_at
                limit = self.timeout_s if self.phase in STEP_PHASES else self.long_phase_timeout_s
                if stalled < limit:
                    continue
                peers = self._peers()
            except Exception as error:  # noqa: BLE001  the store went with its host: torch's timeout decides
                logger.debug("hang watch: rendezvous store unreachable: %s", error)
                continue
            # A peer stopped just after this rank's last step still had a fresh heartbeat then: give the picture
            # up to another timeout to clear before saying that no rank can be told apart.
            if culprits(self.iteration, peers, time.time(), self.silent_s) or stalled >= 2 * limit:
                self._report_and_exit(stalled, limit, peers)

    def _peers(self) -> Dict[int, Optional[dict]]:
        """Every other rank's last heartbeat (None: none written yet)."""
        keys = [KEY.format(restart=self.restart, rank=r) for r in range(self.world) if r != self.rank]
        present = [key for key in keys if self.store.check([key])]
        values = dict(zip(present, self.store.multi_get(present))) if present else {}
        return {r: json.loads(values[key]) if key in values else None
                for r, key in zip([r for r in range(self.world) if r != self.rank], keys)}

    def _report_and_exit(self, stalled: float, limit: float, peers: Dict[int, Optional[dict]]) -> None:
        line = hang_report(self.rank, self.iteration, self.phase, stalled, limit, peers, time.time(), self.silent_s,
                           last_collective(self.timers))
        logger.error("%s", line)
        if self.on_hang is not None:
            try:
                self.on_hang(line)
            except Exception as error:  # noqa: BLE001  the exit must happen whatever the record does
                logger.warning("hang watch: recording the hang failed: %s", error)
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where this rank waits
        sys.stderr.write(f"collectives in flight on rank {self.rank} (domino's comm records): "
                         f"{collectives_in_flight(self.timers) or 'none'}\n")
        _dump_flight_recorder()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)  # the training thread is blocked in C++: only the process can end here


def last_collective(timers: Dict[str, CommTimer]) -> Optional[str]:
    """The collective this rank entered last, with its group (``"tp: fwd attention, mid layer, chunk 0"``)."""
    entered = [f"{name}: {timer.entered}" for name, timer in timers.items() if timer.entered]
    return "; ".join(entered) or None


def collectives_in_flight(timers: Dict[str, CommTimer]) -> str:
    """The collectives launched and not yet waited for, by group: gloo keeps no flight recorder, these do."""
    return "; ".join(f"{name}: {site}" for name, timer in timers.items() for site in list(timer.in_flight.values()))


def culprits(iteration: int, peers: Dict[int, Optional[dict]], now: float, silent_s: float) -> List[int]:
    """The ranks that hold the others: a heartbeat silent for ``silent_s`` first, else the ranks behind the newest
    iteration."""
    silent = [r for r, hb in peers.items() if hb is None or now - float(hb["t"]) > silent_s]
    if silent:
        return silent
    newest = max([iteration, *(int(hb["iteration"]) for hb in peers.values())])
    return [r for r, hb in peers.items() if int(hb["iteration"]) < newest]


def hang_report(rank: int, iteration: int, phase: str, stalled: float, limit: float,
                peers: Dict[int, Optional[dict]], now: float, silent_s: float,
                collective: Optional[str] = None) -> str:
    """The one line a stalled rank logs before it exits (``collective``: the last one this rank entered)."""
    found = culprits(iteration, peers, now, silent_s)
    waits = f", last collective entered {collective}" if collective else ""
    head = (f"no progress on rank {rank} for {stalled:.0f} s (limit {limit:g} s, --hang-timeout-s) after iteration "
            f"{iteration} in '{phase}'{waits}: ")
    if not found:
        return head + ("every rank waits at the same point (a collective that does not complete: the network, or a "
                       f"device); exiting {HANG_EXIT_CODE}")
    named = []
    for r in found:
        hb = peers[r]
        if hb is None:  # a rank that never wrote one
            named.append(f"rank {r} (never sent a heartbeat)")
            continue
        silent = now - float(hb["t"])
        why = (f"its heartbeat stopped {silent:.0f} s ago: the process is stopped or frozen" if silent > silent_s
               else "it is behind the others")
        entered = f", last collective entered {hb['collective']}" if hb.get("collective") else ""
        named.append(f"rank {r} (host {hb['host']}, pid {hb['pid']}, last iteration {hb['iteration']} in "
                     f"'{hb['phase']}'{entered}; {why})")
    return head + "held by " + "; ".join(named) + f"; exiting {HANG_EXIT_CODE}"


def _dump_flight_recorder() -> None:
    """torch's record of the collectives in flight, to stderr, where it kept one (NCCL)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None or not torch.cuda.is_available():
        return
    try:
        sys.stderr.write(f"flight recorder (collectives in flight): {dump(includeCollectives=True, onlyActive=True)!r}\n")
    except Exception as error:  # noqa: BLE001  a report: the exit follows either way
        sys.stderr.write(f"flight recorder not dumped: {error}\n")
