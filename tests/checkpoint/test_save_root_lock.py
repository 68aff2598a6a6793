"""One writer per save root (issue 56, item 2; ``domino/checkpoint/save_root.py``): real ``domino pretrain``
processes on one ``--save``, real record locks, a real SIGKILL.

Before the fix two runs started 0.2 s apart with one ``--save`` both exited 2 (``SafetensorError ... No such
file``, ``FileNotFoundError: .../.tmp-iter_0000001/rng/...``): they shared the temporary directory and each
save's ``prepare`` removed it. Now the second run waits for the first (a replacement pod for its predecessor's
SIGTERM save) and resumes after it, or stops in one line naming the holder once ``--save-lock-timeout-s`` has
passed; a holder that was SIGKILLed holds nothing, so the next run takes the root at once.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from train.train_helpers import child_env, pretrain_command, run_pretrain

from domino.checkpoint import manifest
from domino.checkpoint.save_root import HOLDER_FILE
from domino.config import ConfigError, parse_config

ARGS = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--num-layers", "1", "--log-interval", "1",
        "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "0", "--train-iters", "2",
        "--save-interval", "1"]


def _start(args, log, env=None) -> subprocess.Popen:
    """A fresh `domino pretrain` process (the zygote serves one job at a time), its output in ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(pretrain_command(args), env=child_env(env), stdout=out, stderr=subprocess.STDOUT)


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the first run ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _saving(log) -> bool:
    """Whether the run logging to ``log`` is inside its first (slowed-down) save: it writes into the root."""
    return "this save takes" in log.read_text()


def _holder(save) -> dict:
    return json.loads((save / HOLDER_FILE).read_text())


def _intact(save, tag) -> bool:
    return (save / tag).is_dir() and manifest.find_damage(save / tag) is None


@contextlib.contextmanager
def _first_run_saving(tmp_path, slow_s: int):
    """Starts a first run on ``tmp_path/ckpt`` whose commits take ``slow_s`` s longer and yields ``(save root, its
    arguments, its process)`` once it is inside its first save (it holds the root); kills it at the end."""
    save = tmp_path / "ckpt"
    args = [*ARGS, "--save", str(save)]
    first = _start(args, tmp_path / "first.log", {"DOMINO_FAULT_INJECT": f"slow-save:{slow_s}"})
    try:
        _wait_for(lambda: _saving(tmp_path / "first.log"), first, "first save")
        yield save, args, first
    finally:
        first.kill()
        first.wait()


def test_a_second_run_waits_for_the_holder_then_stops_in_one_line_naming_it_on_every_rank(tmp_path):
    # Each commit 5 s longer: the first run holds the root while the second one waits out its timeout.
    with _first_run_saving(tmp_path, 5) as (save, args, first):
        # Two ranks: rank 1 waits in the agreement while rank 0 waits for the lock, and both stop.
        second = run_pretrain([*args, "--save-lock-timeout-s", "1"], nproc=2, check=False)
        assert second.returncode != 0, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if "domino pretrain: error:" in line]
        assert len(errors) == 2 and "is held by another live run" in errors[0], second.stderr[-3000:]
        assert _holder(save)["pid"] == first.pid
        started = _holder(save)["started"]
        refusal = (f"--save {save} is held by another live run (host {socket.gethostname()}, pid {first.pid}, "
                   f"started {started}) after waiting 1 s (--save-lock-timeout-s): stop it, wait for it, or give this "
                   "run another --save")
        assert errors == [f"domino pretrain: error: rank 0 (node {socket.gethostname()}) failed while taking --save "
                          f"{save}: {refusal}"] * 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        # A reader is not a writer: it reads the held root's committed checkpoint meanwhile.
        _wait_for(lambda: (save / "latest").exists(), first, "first checkpoint")
        inspect = subprocess.run([sys.executable, "-m", "domino", "checkpoint", "inspect", "--load", str(save),
                                  "--no-progress"], env=child_env(), capture_output=True, text=True, timeout=120)
        assert inspect.returncode == 0, inspect.stderr[-2000:]
        assert first.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert (save / "latest").read_text().strip() == "iter_0000002"
    assert _intact(save, "iter_0000001") and _intact(save, "iter_0000002")
    assert not list(save.glob(".tmp-*"))  # the refused run wrote nothing


def test_a_lone_second_run_stops_with_the_reason_alone(tmp_path):
    with _first_run_saving(tmp_path, 60) as (save, args, first):
        second = run_pretrain([*args, "--save-lock-timeout-s", "0"], check=False)
        assert second.returncode == 2, second.stderr[-3000:]
        last = [line for line in second.stderr.splitlines() if line.strip()][-1]
        assert last.startswith(f"domino pretrain: error: --save {save} is held by another live run (host "), last
        assert f"pid {first.pid}, started " in last and "after waiting 0 s (--save-lock-timeout-s)" in last


def test_two_runs_started_together_one_waits_for_the_other_and_resumes_after_it(tmp_path):
    """The issue's reproduction: the same command twice, 0.2 s apart."""
    save = tmp_path / "ckpt"
    args = [*ARGS, "--save", str(save)]
    slow = {"DOMINO_FAULT_INJECT": "slow-save:3"}  # the first to start holds the root for 6 s at least: they overlap
    runs = [_start(args, tmp_path / "a.log", slow)]
    time.sleep(0.2)
    runs.append(_start(args, tmp_path / "b.log", slow))
    try:
        codes = [run.wait(timeout=300) for run in runs]
    finally:
        for run in runs:
            run.kill()
            run.wait()
    logs = [(tmp_path / name).read_text() for name in ("a.log", "b.log")]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    waited = [log for log in logs if "is held by another live run" in log]
    assert len(waited) == 1, logs
    # It waited until the first had saved its last iteration, and resumed from there.
    assert "nothing left to train at iteration 2 of 2" in waited[0], waited[0][-3000:]
    assert (save / "latest").read_text().strip() == "iter_0000002"
    assert _intact(save, "iter_0000001") and _intact(save, "iter_0000002")
    assert not list(save.glob(".tmp-*"))


def test_a_sigkilled_holder_holds_nothing_the_next_run_takes_the_root_at_once(tmp_path):
    with _first_run_saving(tmp_path, 60) as (save, args, first):
        # Killed inside its first save: its record and its own temporary directory stay behind.
        token = _holder(save)["token"]
        assert (save / f".tmp-iter_0000001.{token}").is_dir()
        first.send_signal(signal.SIGKILL)
        first.wait()
    started = time.monotonic()
    second = run_pretrain([*args, "--save-lock-timeout-s", "0"])  # would refuse if the dead holder counted
    assert time.monotonic() - started < 60
    assert "is held by another live run" not in second.stderr
    assert f"interrupted saves from {save}: .tmp-iter_0000001.{token}" in second.stderr
    record = _holder(save)
    assert record["pid"] != first.pid and record["token"] != token  # the new holder's record
    assert (save / "latest").read_text().strip() == "iter_0000002" and _intact(save, "iter_0000002")


def test_a_wait_that_is_not_a_finite_number_of_seconds_is_refused_in_one_line():
    for bad in ("-1", "nan", "inf"):
        # nan and inf meet the check every float setting has first (domino/config/bounds.py), -1 this setting's own
        with pytest.raises(ConfigError, match=f"--save-lock-timeout-s must be a finite number( of seconds >= 0)?, "
                                              f"got {float(bad)}"):
            parse_config(["--preset", "tiny", "--mock-data", "--save-lock-timeout-s", bad])
