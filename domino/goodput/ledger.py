"""The goodput ledger: an append-only record of every attempt of a run, in ``<save>/goodput.jsonl``.

An *attempt* is one life of rank 0's process: started by a pod, torchrun or a person, ended by finishing, a
SIGTERM, a failure or a kill. Rank 0 appends one JSON line per event and fsyncs it before going on, so what an
attempt recorded survives its SIGKILL; a line cut short by a kill mid-write is skipped by the reader. Events are
rare (start-up, each save, evaluation, log interval and the end), so the fsyncs cost nothing a step would notice.

Each line is ``{"attempt": ID, "event": NAME, "t": UNIX_TIME, ...}``; the events, in the order an attempt writes
them:

==================  ====================================================================================
``start``           ``process_start`` (the process's own start, from ``/proc``; for an in-process restart
                    the failure it recovers from), ``runtime_ready`` (torch.distributed and the groups up),
                    ``model_built``, ``t`` = checkpoint loaded; ``load_s`` (reading the checkpoint),
                    ``loaded_iteration``, ``host``, ``pid``; ``inprocess_restart`` (the restart's number, for an
                    attempt made by ``--inprocess-restart`` in a process that already ran one)
``training``        the loop starts at ``iteration``
``first_step``      the first iteration returned to the host (the device may still be running it)
``progress``        ``iteration`` reached, at each log interval (after the loss is read: the device is done)
``save``            ``iteration`` saved; ``blocking_s`` the time the loop waited for it (for an asynchronous
                    save: the snapshot)
``durable``         ``iteration``'s checkpoint committed
``evaluation``      ``split``, ``seconds``
``straggler``       ``seconds`` a log interval lost to running at the slowest rank's pace, ``ranks``
                    (``--log-straggler``)
``end``             ``how``: finished, sigterm, failed or hung (a hung peer named, ``--hang-timeout-s``);
                    ``iteration``; ``loop_end`` (the last step's end)
==================  ====================================================================================

Clocks are the hosts' wall clocks (``time.time``): attempts on different nodes compare as well as their clocks
agree (NTP keeps them within milliseconds; a report over seconds-long phases does not notice).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

#: The ledger's file name inside a run's save root.
LEDGER_FILE = "goodput.jsonl"

logger = logging.getLogger(__name__)


def process_start_time() -> float:
    """This process's start as a UNIX time, to the kernel's clock tick (10 ms); now where there is no ``/proc``.

    ``/proc/self/stat``'s field 22 is the start in clock ticks after boot on the boot-time clock (proc(5); Linux
    ``fs/proc/array.c`` reports ``task->start_boottime``), so the age is ``CLOCK_BOOTTIME`` minus it; ``/proc/stat``'s
    ``btime`` would do too, but it is rounded to whole seconds.
    """
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


@dataclass(frozen=True)
class AttemptOrigin:
    """Where an attempt began, for its ``start`` record."""

    began: float
    """UNIX time: the process's start, or for an in-process restart the failure it recovers from."""
    inprocess_restart: int = 0
    """0 for a process's first attempt; n for the n-th ``--inprocess-restart`` in the same process."""

    @classmethod
    def new_process(cls) -> "AttemptOrigin":
        """The first attempt of this process, begun at the process's start."""
        return cls(process_start_time())


class Ledger:
    """Appends this attempt's events to ``root/goodput.jsonl`` (made on rank 0 only; elsewhere a no-op).

    Args:
        root: the run's save root (``--save``); None turns the ledger off.
        enabled: whether this process writes (global rank 0).
    """

    def __init__(self, root: Optional[str], enabled: bool) -> None:
        self.path = Path(root) / LEDGER_FILE if root and enabled else None
        self.attempt = uuid.uuid4().hex[:12]
        self.failed_once = False
        # The earlier attempts' events, read once, and this attempt's: the running account needs no re-read. Kept
        # compact (a run of progress records shrinks to its last), so the account at each log interval stays cheap
        # however long the run; the file keeps every record.
        self.events: List[Dict[str, Any]] = []
        if self.path is not None and self.path.is_file():
            for event in read_events(str(self.path.parent)):
                self._remember(event)

    def record(self, event: str, t: Optional[float] = None, **fields: Any) -> None:
        """Appends one event (durable when this returns). A ledger that cannot be written is logged once and then
        left alone: the ledger measures the run, it never stops it."""
        if self.path is None:
            return
        entry = {"attempt": self.attempt, "event": event, "t": time.time() if t is None else t, **fields}
        self._remember(entry)
        line = json.dumps(entry)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                os.write(fd, (line + "\n").encode())  # O_APPEND: one write, at the end, whoever else appends
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as error:
            if not self.failed_once:
                logger.warning("goodput ledger %s not written (%s); training goes on", self.path, error)
            self.failed_once = True

    def _remember(self, entry: Dict[str, Any]) -> None:
        last = self.events[-1] if self.events else None
        if (entry["event"] == "progress" and last is not None and last["event"] == "progress"
                and last["attempt"] == entry["attempt"]):
            self.events[-1] = entry  # the account reads only an attempt's latest progress between other records
        else:
            self.events.append(entry)

    def start(self, origin: AttemptOrigin, runtime_ready: float, model_built: float, load_s: float,
              loaded_iteration: int) -> None:
        """The attempt's start-up, recorded once the checkpoint is loaded (nothing is written to the root earlier)."""
        restart = {"inprocess_restart": origin.inprocess_restart} if origin.inprocess_restart else {}
        self.record("start", process_start=origin.began, runtime_ready=runtime_ready, model_built=model_built,
                    load_s=load_s, loaded_iteration=loaded_iteration, host=socket.gethostname(), pid=os.getpid(),
                    **restart)


def read_events(root: str) -> List[Dict[str, Any]]:
    """The ledger's events in file order; a line a kill cut short (or any unreadable line) is skipped.

    Raises:
        FileNotFoundError: when ``root`` has no ledger.
    """
    path = Path(root) / LEDGER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no goodput ledger (runs write it into their --save directory)")
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if _well_formed(event):
                out.append(event)
    return out


#: The numeric fields of the events (``loop_end`` may also be null).
_NUMBERS = ("t", "process_start", "runtime_ready", "model_built", "load_s", "loaded_iteration", "iteration",
            "blocking_s", "seconds", "loop_end", "inprocess_restart")


def _well_formed(event: Any) -> bool:
    """Whether an event has the fields the account reads, of the right types (a hand-edited or damaged line is
    dropped, never a reason for the account to fail)."""
    if not (isinstance(event, dict) and isinstance(event.get("attempt"), str) and isinstance(event.get("event"), str)
            and "t" in event):
        return False
    for key in _NUMBERS:
        value = event.get(key)
        if key in event and not (value is None and key == "loop_end") and not (
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
            return False
    return True
