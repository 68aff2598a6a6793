"""Where a run's wall time went: the ledger's events summed into parts that add up to the wall time.

The definitions follow Google's ML Goodput Measurement library (``AI-Hypercomputer/ml-goodput-measurement``,
``ml_goodput_measurement/src/goodput.py``, ``GoodputCalculator``; its badput types in ``goodput_utils.py``): the
job's time runs from the first attempt's start to the last attempt's end, restarts included; goodput is the
productive training time over it; a step counts once, so steps run again after a disruption are "wasted progress
from disruption", and the time a save blocks training is taken out of the productive time. domino's parts:

================  ==============================================================================================
``productive_s``  step time of the iterations that count: each attempt's steps up to the iteration a later
                  attempt resumed from (all of them for the last attempt)
``startup_s``     process start to the first step: imports, rendezvous, model, checkpoint load (its
                  ``checkpoint_load_s`` is also shown on its own); ml-goodput's TPU_INITIALIZATION,
                  TRAINING_PREP and UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME
``checkpoint_s``  saves' blocking time (UNPRODUCTIVE_CHECKPOINT_SAVE_TIME)
``evaluation_s``  evaluation during and after training
``lost_s``        steps run after the last checkpoint a later attempt resumed from (WASTED_PROGRESS_FROM_DISRUPTION)
``idle_s``        between attempts: from an attempt's last record to the next process's start (a killed
                  attempt's partial step, the pod's exit, queueing, scheduling, the image, torchrun; for an
                  in-process restart, leaving the failed groups and meeting the peers)
``other_s``       the rest of an attempt: its end after the loop (closing files, the tracking run)
================  ==============================================================================================

The parts add up to ``wall_s`` exactly; ``goodput = productive_s / wall_s``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional

PARTS = ("productive_s", "startup_s", "checkpoint_s", "evaluation_s", "lost_s", "idle_s", "other_s")
LABELS = {"productive_s": "productive", "startup_s": "start-up", "checkpoint_s": "checkpoint saves",
          "evaluation_s": "evaluation", "lost_s": "lost (steps run again)", "idle_s": "idle between attempts",
          "other_s": "other"}


@dataclasses.dataclass(frozen=True)
class Parts:
    """Where time went, in seconds (the table above); an attempt's and a run's parts each add up to their time."""

    productive_s: float
    startup_s: float
    checkpoint_s: float
    evaluation_s: float
    lost_s: float
    idle_s: float
    """For an attempt: before it started, since the previous attempt's last record."""
    other_s: float
    checkpoint_load_s: float
    """Part of ``startup_s``: reading the checkpoint."""
    straggler_s: float
    """Part of ``productive_s``: what the slowest rank's pace cost over the median's (``--log-straggler``)."""


@dataclasses.dataclass(frozen=True)
class Attempt(Parts):
    """One attempt's account (``start``/``end`` are UNIX times)."""

    attempt: str = ""
    host: str = "?"
    pid: int = 0
    start: float = 0.0
    end: float = 0.0
    how: str = "killed"
    """finished, sigterm, failed, hung (it named a hung rank, :mod:`domino.runtime.hang_watch`), killed (no end
    recorded), or running (the newest attempt, no end yet)."""
    loaded_iteration: int = 0
    last_iteration: int = 0
    last_durable: Optional[int] = None
    inprocess_restart: int = 0
    """n when ``--inprocess-restart`` made this attempt in the process of the previous one (its n-th restart): its
    ``idle_s`` and ``startup_s`` are the recovery's cost."""


@dataclasses.dataclass(frozen=True)
class GoodputReport(Parts):
    """A run's account over all its attempts."""

    attempts: List[Attempt] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    goodput: float = 0.0
    """``productive_s / wall_s``."""

    def to_dict(self) -> Dict[str, Any]:
        """The report as JSON-ready data (``attempts`` is a count; ``per_attempt`` the list)."""
        out = dataclasses.asdict(self)
        out["per_attempt"] = out.pop("attempts")
        out["attempts"] = len(self.attempts)
        return out

    def line(self) -> str:
        """The one-line summary each attempt ends with."""
        parts = ", ".join(f"{LABELS[name]} {_duration(getattr(self, name))}" for name in PARTS[1:]
                          if getattr(self, name) >= 0.05)
        return (f"goodput {100 * self.goodput:.1f} % of {_duration(self.wall_s)} over {len(self.attempts)} "
                f"attempt{'s' * (len(self.attempts) != 1)}: productive {_duration(self.productive_s)}"
                + (f"; {parts}" if parts else ""))


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


class _Timeline:
    """One attempt's events, in the order written."""

    def __init__(self, attempt: str, events: List[Dict[str, Any]]) -> None:
        self.attempt, self.events = attempt, events
        self.start_event = next((e for e in events if e["event"] == "start"), None)
        self.end_event = next((e for e in events if e["event"] == "end"), None)
        training = next((e for e in events if e["event"] == "training"), None)
        self.process_start = float(self.start_event.get("process_start", self.start_event["t"])) \
            if self.start_event else events[0]["t"]
        self.loaded = int(self.start_event.get("loaded_iteration", 0)) if self.start_event else 0
        self.inprocess_restart = int(self.start_event.get("inprocess_restart", 0)) if self.start_event else 0
        self.training_t = training["t"] if training else None
        self.last_t = max(e["t"] for e in events)
        self.end_t = self.end_event["t"] if self.end_event else self.last_t
        iterations = [int(e["iteration"]) for e in events if "iteration" in e and
                      e["event"] in ("progress", "save", "durable", "end", "first_step")]
        self.last_iteration = max([self.loaded, *iterations])
        durable = [int(e["iteration"]) for e in events if e["event"] == "durable"]
        self.last_durable = max(durable) if durable else None
        if self.end_event is not None:
            self.loop_end = float(self.end_event.get("loop_end") or self.end_t)  # None: failed before the loop
        else:  # killed: the loop's last sign of life
            marks = [e["t"] for e in events if e["event"] in ("progress", "save", "durable", "evaluation",
                                                              "first_step", "training")]
            self.loop_end = max(marks) if marks else self.end_t

    def blocked(self, before: float, after: float = -math.inf) -> tuple:
        """(save blocking, evaluation) seconds of the pauses that ended in (after, before]."""
        saves = sum(float(e.get("blocking_s", 0)) for e in self.events
                    if e["event"] == "save" and after < e["t"] <= before)
        evals = sum(float(e.get("seconds", 0)) for e in self.events
                    if e["event"] == "evaluation" and after < e["t"] <= before)
        return saves, evals

    def step_end(self, iteration: int) -> Optional[float]:
        """When this attempt's iteration ``iteration`` finished (the start of its save, or its progress record)."""
        for e in self.events:
            if e.get("iteration") == iteration and e["event"] == "save":
                return e["t"] - float(e.get("blocking_s", 0))
        for e in self.events:
            if e.get("iteration") == iteration and e["event"] in ("progress", "first_step"):
                return e["t"]
        return None


def account(events: List[Dict[str, Any]], now: Optional[float] = None) -> GoodputReport:
    """Sums a ledger's events (:func:`domino.goodput.ledger.read_events`) into a report.

    Args:
        events: the ledger's events, in file order.
        now: when given, the newest attempt, if it has no ``end`` yet, runs until ``now`` (a live run); by
            default it ends at its last record.
    """
    order: List[str] = []
    grouped: Dict[str, List[Dict[str, Any]]] = {}
    for event in events:
        if event["attempt"] not in grouped:
            order.append(event["attempt"])
            grouped[event["attempt"]] = []
        grouped[event["attempt"]].append(event)
    timelines = sorted((_Timeline(a, grouped[a]) for a in order), key=lambda tl: tl.process_start)
    if not timelines:
        raise ValueError("the goodput ledger has no events")
    attempts: List[Attempt] = []
    previous_end: Optional[float] = None
    for index, tl in enumerate(timelines):
        later = timelines[index + 1:]
        newest = not later
        end = tl.end_t if not (newest and tl.end_event is None and now is not None) else max(now, tl.end_t)
        # An attempt that started before the previous one ended (a replacement waiting for the save root) starts,
        # for the account, where the previous one ended: the overlap was spent by the previous attempt.
        start = tl.process_start if previous_end is None else max(tl.process_start, previous_end)
        idle = 0.0 if previous_end is None else max(0.0, start - previous_end)
        training_t = max(tl.training_t, start) if tl.training_t is not None else None
        load_s = float(tl.start_event.get("load_s", 0)) if tl.start_event else 0.0
        about = dict(attempt=tl.attempt, host=_host(tl), pid=_pid(tl), start=start, end=end, how=_how(tl, newest),
                     loaded_iteration=tl.loaded, last_iteration=tl.last_iteration, last_durable=tl.last_durable,
                     checkpoint_load_s=load_s, idle_s=idle, inprocess_restart=tl.inprocess_restart,
                     straggler_s=sum(float(e.get("seconds", 0)) for e in tl.events if e["event"] == "straggler"))
        if training_t is None:  # never reached the loop: all of it was start-up
            attempts.append(Attempt(productive_s=0.0, startup_s=end - start, checkpoint_s=0.0, evaluation_s=0.0,
                                    lost_s=0.0, other_s=0.0, **about))
            previous_end = end
            continue
        loop_end = min(max(tl.loop_end, training_t), end)
        saves_in_loop, evals_in_loop = tl.blocked(loop_end)
        saves_after, evals_after = tl.blocked(end, after=loop_end)
        steps = max(0.0, loop_end - training_t - saves_in_loop - evals_in_loop)
        if newest and tl.end_event is None and now is not None:
            steps += end - loop_end  # still training
            loop_end = end
        # The iterations that count: up to the oldest checkpoint a later attempt resumed from.
        resumed_from = min((later_tl.loaded for later_tl in later), default=None)
        if resumed_from is None or resumed_from >= tl.last_iteration:
            productive = steps
        elif resumed_from <= tl.loaded:
            productive = 0.0
        else:
            cut = tl.step_end(resumed_from)
            if cut is None:  # resumed from a checkpoint this attempt did not write: count none of it
                productive = 0.0
            else:
                cut = min(max(cut, training_t), loop_end)
                saves_before, evals_before = tl.blocked(cut)
                productive = min(steps, max(0.0, cut - training_t - saves_before - evals_before))
        other = max(0.0, end - loop_end - saves_after - evals_after)
        attempts.append(Attempt(productive_s=productive, startup_s=training_t - start,
                                checkpoint_s=saves_in_loop + saves_after, evaluation_s=evals_in_loop + evals_after,
                                lost_s=steps - productive, other_s=other, **about))
        previous_end = end
    wall = attempts[-1].end - attempts[0].start
    totals = {name: sum(getattr(a, name) for a in attempts) for name in PARTS}
    # Pauses recorded with more time than their window held (clock steps, a save event at the very end) would
    # make the parts exceed the wall time; what is left unexplained goes to other_s, so the parts sum exactly.
    totals["other_s"] = wall - sum(v for k, v in totals.items() if k != "other_s")
    return GoodputReport(attempts=attempts, wall_s=wall, checkpoint_load_s=sum(a.checkpoint_load_s for a in attempts),
                         straggler_s=sum(a.straggler_s for a in attempts),
                         goodput=totals["productive_s"] / wall if wall > 0 else 0.0, **totals)


def running_figures(events: List[Dict[str, Any]], now: float) -> Dict[str, Any]:
    """The run's goodput up to ``now``, for a metrics record: ``goodput`` (0-1) and ``goodput_s`` (seconds: the
    wall time and its parts); empty without events."""
    if not events:
        return {}
    report = account(events, now=now)
    return {"goodput": report.goodput,
            "goodput_s": {"wall_s": report.wall_s, **{part: getattr(report, part) for part in PARTS}}}


def _how(tl: _Timeline, newest: bool) -> str:
    if tl.end_event is not None:
        return str(tl.end_event.get("how", "finished"))
    return "running" if newest else "killed"


def _host(tl: _Timeline) -> str:
    return str(tl.start_event.get("host", "?")) if tl.start_event else "?"


def _pid(tl: _Timeline) -> int:
    return int(tl.start_event.get("pid", 0)) if tl.start_event else 0


def format_report(report: GoodputReport) -> str:
    """A table of the attempts and the totals, for ``domino goodput``; an attempt that an in-process restart made
    shows as ``ID+n`` (its restart's number)."""
    header = (f"{'attempt':<13}{'host':<14}{'ended':<10}{'iterations':>13}{'wall':>10}{'productive':>12}"
              f"{'start-up':>10}{'ckpt':>8}{'eval':>8}{'lost':>8}{'idle':>8}")
    rows = [header]
    for a in report.attempts:
        name = f"{a.attempt[:10]}+{a.inprocess_restart}" if a.inprocess_restart else a.attempt
        rows.append(f"{name:<13}{a.host[:13]:<14}{a.how:<10}{f'{a.loaded_iteration}-{a.last_iteration}':>13}"
                    f"{a.end - a.start + a.idle_s:>9.1f}s{a.productive_s:>11.1f}s{a.startup_s:>9.1f}s"
                    f"{a.checkpoint_s:>7.1f}s{a.evaluation_s:>7.1f}s{a.lost_s:>7.1f}s{a.idle_s:>7.1f}s")
    rows.append(report.line())
    rows.append(f"  of the start-up, reading checkpoints: {report.checkpoint_load_s:.1f} s")
    restarted = [a for a in report.attempts if a.inprocess_restart]
    if restarted:
        rows.append(f"  in-process restarts (--inprocess-restart): {len(restarted)}, recovering in "
                    f"{sum(a.idle_s + a.startup_s for a in restarted):.1f} s (their idle time and start-up)")
    if report.straggler_s:
        rows.append(f"  of the productive time, running at a straggler's pace (--log-straggler): "
                    f"{report.straggler_s:.1f} s")
    return "\n".join(rows)
