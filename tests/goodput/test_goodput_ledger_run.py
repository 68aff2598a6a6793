"""The ledger of a real run the test interrupts: SIGKILLed, then SIGTERMed, then finished.

The test owns the timeline: it notes when it starts each ``domino pretrain`` process and when each has exited,
and waits a known time between attempts. The account must place every attempt inside those bounds, find the
two idle gaps, the steps the SIGKILL cost, and add its parts up to the wall time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from domino.goodput.accounting import PARTS
from train.train_helpers import TINY, child_env, pretrain_command, train_losses

IDLE_S = 1.5


def _attempt(args, metrics, stop_after=None, sig=None):
    """Runs one attempt; with ``sig``, sends it once ``stop_after`` is logged. Returns (started, ended, code)."""
    started = time.time()
    proc = subprocess.Popen(pretrain_command(args), env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        if sig is not None:
            deadline = time.monotonic() + 180
            while not (metrics.exists() and max(train_losses(metrics), default=0) >= stop_after):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
                time.sleep(0.02)
            proc.send_signal(sig)
        stderr = proc.communicate(timeout=180)[1]
    finally:
        proc.kill()
        proc.wait()
    return started, time.time(), proc.returncode, stderr


def test_the_ledger_of_a_killed_then_preempted_then_finished_run(tmp_path):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = [*TINY, "--mock-data", "--vocab-size", "256", "--train-iters", "16", "--save-interval", "4", "--save",
            str(save), "--load", str(save), "--metrics-file", str(metrics), "--eval-iters", "0",
            "--eval-interval", "0", "--exit-signal-handler"]
    bounds = []
    s, e, code, _ = _attempt(args, metrics, stop_after=6, sig=signal.SIGKILL)  # iterations 5-6 lost
    assert code == -signal.SIGKILL
    bounds.append((s, e))
    time.sleep(IDLE_S)
    s, e, code, _ = _attempt(args, metrics, stop_after=9, sig=signal.SIGTERM)
    assert code == 143
    bounds.append((s, e))
    time.sleep(IDLE_S)
    s, e, code, stderr = _attempt(args, metrics)
    assert code == 0, stderr[-3000:]
    bounds.append((s, e))
    assert "goodput " in stderr and " over 3 attempts: productive " in stderr  # the attempt's last line

    out = subprocess.run([sys.executable, "-m", "domino", "goodput", "--load", str(save), "--json"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    attempts = report["per_attempt"]
    assert report["attempts"] == 3
    assert [a["how"] for a in attempts] == ["killed", "sigterm", "finished"]
    assert [a["loaded_iteration"] for a in attempts][:2] == [0, 4]
    assert attempts[2]["loaded_iteration"] >= 9 and attempts[2]["last_iteration"] == 16
    for attempt, (started, ended) in zip(attempts, bounds):
        # /proc's start time has a 10 ms tick; the account's start may move later only past an overlap
        assert started - 0.05 <= attempt["start"] and attempt["end"] <= ended
    assert attempts[1]["idle_s"] >= IDLE_S and attempts[2]["idle_s"] >= IDLE_S
    assert attempts[0]["lost_s"] > 0 and attempts[1]["lost_s"] == 0 == attempts[2]["lost_s"]
    assert attempts[0]["last_durable"] == 4 and attempts[0]["last_iteration"] >= 6
    assert all(a["startup_s"] > 0 and a["productive_s"] > 0 for a in attempts)
    assert sum(report[part] for part in PARTS) == pytest.approx(report["wall_s"])
    assert report["wall_s"] <= bounds[-1][1] - bounds[0][0] + 0.05
    assert 0 < report["goodput"] < 1
