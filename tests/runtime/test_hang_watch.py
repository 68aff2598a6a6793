"""--hang-timeout-s: a rank stopped with SIGSTOP is named by its peer within the timeout, with its host and pid.

Real torchrun (torch 2.13), two ranks (TP 2, or PP 2 with asynchronous saves), ``--distributed-timeout-minutes 1``: without the watch the peer would
wait the full minute in its collective and the error would name no rank (checked: with ``--hang-timeout-s 0`` the
job is still running 30 s after the SIGSTOP).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from domino.launch.processes import alive, children, process_tree, signal_tree
from domino.runtime.hang_watch import HANG_EXIT_CODE, collectives_in_flight, culprits, hang_report, last_collective
from train.train_helpers import child_env, pretrain_command, rank_of, read_metrics

ARGS = ["--preset", "tiny", "--seed", "7", "--mock-data", "--vocab-size", "256", "--num-workers", "0",
        "--tensor-model-parallel-size", "2", "--train-iters", "100000", "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", "0", "--distributed-timeout-minutes", "1", "--hang-timeout-s", "3"]


@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                                         "--micro-batch-size", "2", "--global-batch-size", "4", "--async-save", "--save-interval", "3"]], ids=["tp2", "pp2-async-save"])
def test_a_stopped_rank_is_named_by_its_peer_within_the_timeout(tmp_path, layout):
    """TP 2: the peer waits in a TP collective. PP 2 with asynchronous saves every 3 steps: the peer waits for a
    stage's activations or gradients, with a save's writer thread possibly running beside it."""
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(pretrain_command([*ARGS, *layout, "--metrics-file", str(metrics),
                                              "--save", str(tmp_path / "ckpt")], nproc=2),
                            env=child_env({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and len(read_metrics(metrics)) >= 5):  # past the first steps
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        ranks = sorted(children(proc.pid), key=lambda pid: rank_of(pid))
        stopped = ranks[1]
        signalled = time.monotonic()
        signal_tree([stopped], signal.SIGSTOP)
        lines, named_at = [], None
        for line in proc.stdout:
            lines.append(line)
            if named_at is None and "held by rank 1" in line:
                named_at = time.monotonic()
            if named_at is not None and not alive(ranks[:1]):  # rank 0 left (torchrun waits 30 s for rank 1)
                break
        signal_tree(process_tree(proc.pid), signal.SIGKILL)
        output = "".join(lines) + proc.stdout.read()  # what rank 0 wrote last (its stacks)
    finally:
        signal_tree(process_tree(proc.pid), signal.SIGCONT)
        signal_tree(process_tree(proc.pid), signal.SIGKILL)
        proc.wait()
    line = next((l for l in output.splitlines() if "held by rank 1" in l), None)
    assert line is not None, output[-4000:]
    assert "[rank 0] ERROR" in line and f"pid {stopped}" in line and "its heartbeat stopped" in line, line
    assert f"exiting {HANG_EXIT_CODE}" in line
    assert "Stack (most recent call first)" in output or "Current thread" in output  # faulthandler's dump
    assert "collectives in flight on rank 0 (domino's comm records): " in output
    if not layout:  # TP 2: rank 0 names the TP collective it waits in (a pipeline without TP has none of ours)
        assert ", last collective entered tp: " in line.split("held by", 1)[0], line
    ledger = json.loads(subprocess.run([sys.executable, "-m", "domino", "goodput", "--load", str(tmp_path / "ckpt"),
                                        "--json"], capture_output=True, text=True, check=True).stdout)
    assert [a["how"] for a in ledger["per_attempt"]] == ["hung"]  # the goodput ledger's record of it
    took = named_at - signalled
    assert took < 15, f"named only after {took:.0f} s (the collective timeout is 60 s)"



def _hb(t, iteration, phase="step"):
    return {"t": t, "iteration": iteration, "phase": phase, "host": "n1", "pid": 42, "progressed_at": t}


def test_the_culprit_is_the_silent_rank_else_the_rank_behind_else_none():
    now = 100.0
    assert culprits(7, {1: _hb(90, 7), 2: _hb(99.5, 7)}, now, silent_s=5) == [1]  # heartbeat silent 10 s
    assert culprits(7, {1: _hb(99.5, 6), 2: _hb(99.5, 7)}, now, silent_s=5) == [1]  # never reached iteration 7
    assert culprits(7, {1: None, 2: _hb(99.5, 7)}, now, silent_s=5) == [1]  # never wrote a heartbeat
    assert culprits(7, {1: _hb(99.5, 7), 2: _hb(99.5, 7)}, now, silent_s=5) == []
    line = hang_report(0, 7, "step", 31, 30, {1: _hb(99.5, 6), 2: _hb(99.5, 7)}, now, 5)
    assert "held by rank 1 (host n1, pid 42, last iteration 6 in 'step'; it is behind the others)" in line
    assert "every rank waits at the same point" in hang_report(0, 7, "step", 61, 30, {1: _hb(99.5, 7)}, now, 5)
    assert json.dumps(_hb(1, 2))  # heartbeats are plain JSON in the store
    behind = dict(_hb(99.5, 6), collective="tp: fwd mlp, last layer, chunk 0")
    line = hang_report(0, 7, "step", 31, 30, {1: behind}, now, 5, "tp: fwd attention, first layer, chunk 1")
    assert "after iteration 7 in 'step', last collective entered tp: fwd attention, first layer, chunk 1: " in line
    assert "last iteration 6 in 'step', last collective entered tp: fwd mlp, last layer, chunk 0; it is behind" in line


def test_the_comm_records_know_the_collective_entered_and_those_in_flight():
    from domino.runtime.comm_timing import comm_site, launch
    from domino.runtime.mesh import MeshGroup

    class Work:  # a torch.distributed work that is done
        def wait(self):
            return True

    group = MeshGroup.shapes_only(1)
    with comm_site("fwd attention, first layer, chunk 0", group):
        handle = launch(lambda async_op: Work(), 8.0, torch.ones(2), group)
    assert collectives_in_flight({"tp": group.timer}) == "tp: fwd attention, first layer, chunk 0"
    timers = {"tp": group.timer}
    assert last_collective(timers) == "tp: fwd attention, first layer, chunk 0"
    handle.wait()  # waited: no longer in flight
    assert collectives_in_flight(timers) == ""
