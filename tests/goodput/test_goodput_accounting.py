"""The goodput account of a timeline the test writes itself: every part checked against hand arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from domino.goodput.accounting import PARTS, account, format_report
from domino.goodput.ledger import LEDGER_FILE, Ledger, read_events


def _event(attempt, event, t, **fields):
    return {"attempt": attempt, "event": event, "t": float(t), **fields}


#: Three attempts. A trains iterations 1-15, saves 10 (2 s blocking) and is SIGKILLed after 15; B resumes 10,
#: evaluates for 5 s, is SIGTERMed at 20 and saves it (1 s); C resumes 20 and finishes 30,
#: 2.5 s of it at a straggler's pace.
TIMELINE = [
    _event("A", "start", 4, process_start=0, loaded_iteration=0, load_s=0.0, host="node-a", pid=11),
    _event("A", "training", 10, iteration=0),
    _event("A", "progress", 20, iteration=5),
    _event("A", "save", 32, iteration=10, blocking_s=2),     # iteration 10 ended at 30
    _event("A", "durable", 32, iteration=10),
    _event("A", "progress", 40, iteration=15),               # then SIGKILL: no end record
    _event("B", "start", 56, process_start=50, loaded_iteration=10, load_s=3.0, host="node-b", pid=12),
    _event("B", "training", 58, iteration=10),
    _event("B", "evaluation", 70, split="valid", seconds=5),
    _event("B", "save", 81, iteration=20, blocking_s=1),
    _event("B", "durable", 81, iteration=20),
    _event("B", "end", 82, how="sigterm", iteration=20, loop_end=80),
    _event("C", "start", 92, process_start=90, loaded_iteration=20, load_s=1.0, host="node-b", pid=13),
    _event("C", "training", 95, iteration=20),
    _event("C", "straggler", 110, seconds=2.5, ranks=[3]),  # inside productive time, shown apart
    _event("C", "progress", 119, iteration=30),
    _event("C", "end", 120, how="finished", iteration=30, loop_end=119),
]


def test_the_account_of_a_known_timeline():
    report = account(TIMELINE)
    a, b, c = report.attempts
    assert [x.how for x in report.attempts] == ["killed", "sigterm", "finished"]
    assert (a.start, a.end, b.start, c.end) == (0, 40, 50, 120)
    # A: start-up 0-10; steps 10-40 less the 2 s save = 28 s, of which those up to iteration 10 (ended at 30,
    # B resumed there) count: 30 - 10 = 20 s; iterations 11-15 (32-40: 8 s) were lost.
    assert (a.startup_s, a.checkpoint_s, a.productive_s, a.lost_s, a.idle_s) == (10, 2, 20, 8, 0)
    # B: idle 40-50; start-up 50-58; loop 58-80 less 5 s of evaluation = 17 s, all kept (C resumed 20); the
    # SIGTERM save 1 s; 80-82 less that save = 1 s of other.
    assert (b.idle_s, b.startup_s, b.evaluation_s, b.productive_s, b.lost_s, b.checkpoint_s, b.other_s) == \
        (10, 8, 5, 17, 0, 1, 1)
    assert (c.idle_s, c.startup_s, c.productive_s, c.other_s, c.checkpoint_load_s) == (8, 5, 24, 1, 1.0)
    assert report.wall_s == 120
    assert sum(getattr(report, part) for part in PARTS) == pytest.approx(report.wall_s)
    assert (report.productive_s, report.lost_s, report.idle_s) == (61, 8, 18)
    assert report.goodput == pytest.approx(61 / 120)
    assert report.checkpoint_load_s == 4.0
    assert (c.straggler_s, report.straggler_s) == (2.5, 2.5)


def test_a_later_fall_back_to_an_older_checkpoint_takes_back_what_counted():
    """C resuming 10 instead of 20 (B's checkpoint damaged): B's steps are all lost, and A's past 10 still are."""
    timeline = [dict(e, loaded_iteration=10) if e["attempt"] == "C" and e["event"] == "start" else e
                for e in TIMELINE]
    report = account(timeline)
    a, b, _ = report.attempts
    assert (a.productive_s, a.lost_s) == (20, 8)
    assert (b.productive_s, b.lost_s) == (0, 17)
    assert sum(getattr(report, part) for part in PARTS) == pytest.approx(report.wall_s)


def test_an_inprocess_restart_is_marked_and_its_recovery_reported():
    """C made by B's process after B failed (``--inprocess-restart``): its start is B's failure, so the recovery
    (leaving the groups, meeting, reloading) is its idle time and start-up, named in the report."""
    timeline = [dict(e, how="failed") if e["attempt"] == "B" and e["event"] == "end" else e for e in TIMELINE]
    timeline = [dict(e, process_start=82.5, pid=12, inprocess_restart=1) if e["attempt"] == "C" and e["event"] == "start"
                else e for e in timeline]
    report = account(timeline)
    c = report.attempts[-1]
    assert (c.inprocess_restart, c.idle_s, c.startup_s) == (1, 0.5, 12.5)
    assert [a.inprocess_restart for a in report.attempts] == [0, 0, 1]
    table = format_report(report)
    assert "C+1" in table and "in-process restarts (--inprocess-restart): 1, recovering in 13.0 s" in table
    assert "in-process" not in format_report(account(TIMELINE))
    assert sum(getattr(report, part) for part in PARTS) == pytest.approx(report.wall_s)


def test_a_live_run_counts_its_newest_attempt_up_to_now():
    report = account(TIMELINE[:-1], now=130)  # C still training, last record at 119
    assert report.attempts[-1].how == "running"
    assert report.attempts[-1].productive_s == 130 - 95
    assert report.wall_s == 130


def test_the_ledger_skips_a_line_a_kill_cut_short_and_the_cli_reports_it(tmp_path):
    ledger = Ledger(str(tmp_path), enabled=True)
    for event in TIMELINE:
        ledger.attempt = event["attempt"]
        ledger.record(event["event"], **{k: v for k, v in event.items() if k not in ("attempt", "event")})
    with open(tmp_path / LEDGER_FILE, "a") as f:
        f.write('{"attempt": "D", "event": "sta')  # SIGKILL mid-write
    assert read_events(str(tmp_path)) == TIMELINE
    out = subprocess.run([sys.executable, "-m", "domino", "goodput", "--load", str(tmp_path), "--json"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert report["attempts"] == 3 and report["goodput"] == pytest.approx(61 / 120)
    assert {part: report[part] for part in PARTS} == {"productive_s": 61, "startup_s": 23, "checkpoint_s": 3,
                                                      "evaluation_s": 5, "lost_s": 8, "idle_s": 18, "other_s": 2}
    table = subprocess.run([sys.executable, "-m", "domino", "goodput", "--load", str(tmp_path)],
                           capture_output=True, text=True, check=True).stdout
    assert "goodput 50.8 % of 2.0 min over 3 attempts" in table and "node-a" in table


def test_a_ledger_that_cannot_be_written_never_stops_the_run(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ledger = Ledger(str(blocker / "root"), enabled=True)  # a path under a regular file: ENOTDIR
    ledger.record("training", iteration=0)
    ledger.record("progress", iteration=1)
    assert len([r for r in caplog.records if "goodput ledger" in r.getMessage()]) == 1
    with pytest.raises(FileNotFoundError, match="no goodput ledger"):
        read_events(str(tmp_path))


def test_the_ledger_in_memory_keeps_a_long_runs_account_cheap_and_equal(tmp_path):
    """Thousands of progress records (a long run logging every step) shrink to the last of each run in memory, and the
    account from memory equals the account of the whole file."""
    ledger = Ledger(str(tmp_path), enabled=True)
    ledger.attempt = "A"
    ledger.record("start", t=1.0, process_start=0.0, loaded_iteration=0, load_s=0.0)
    ledger.record("training", t=2.0, iteration=0)
    for i in range(1, 2001):
        ledger.record("progress", t=2.0 + i / 100, iteration=i)
        if i % 500 == 0:
            ledger.record("save", t=2.0 + i / 100 + 0.01, iteration=i, blocking_s=0.01)
    assert len(ledger.events) < 20
    assert account(ledger.events) == account(read_events(str(tmp_path)))
    again = Ledger(str(tmp_path), enabled=True)  # the next attempt reads the file once, compactly
    assert account(again.events) == account(read_events(str(tmp_path))) and len(again.events) < 20
