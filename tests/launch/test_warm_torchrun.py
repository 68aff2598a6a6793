"""``python -m domino.cli.torchrun``: torchrun whose ``-m domino`` ranks are forks of an agent that imported torch,
DeepSpeed and domino once; the signal relay starts torchrun this way with ``DOMINO_WARM_RANKS=1``. Real torchrun (torch 2.13) and real ranks:
the ranks are forks (no exec: their command line is the agent's), they train as torchrun's ranks do, and a failing
rank makes torchrun exit 1 as it does for the processes it starts itself (tests/launch/test_torchrun_exit_codes.py).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from domino.launch.processes import children
from domino.launch.signal_relay import warm_torchrun
from train.train_helpers import child_env, read_metrics

ARGS = ["-m", "domino", "pretrain", "--preset", "tiny", "--mock-data", "--vocab-size", "256", "--num-workers", "0",
        "--log-interval", "1", "--tensor-model-parallel-size", "2", "--eval-iters", "0", "--eval-interval", "0"]


def _caught(pid: int) -> set:
    """The signals ``pid`` has a handler for (``SigCgt`` of /proc/PID/status, proc(5))."""
    mask = int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("SigCgt:")).split()[1], 16)
    return {signal.Signals(n) for n in range(1, 32) if mask >> (n - 1) & 1 and n in signal.Signals._value2member_map_}


def _cmdline(pid: int) -> list:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_the_relay_starts_torchrun_warm_only_for_domino():
    on = {"DOMINO_WARM_RANKS": "1"}
    warm = [sys.executable, "-m", "domino.cli.torchrun", "--nproc-per-node", "2", "-m", "domino", "pretrain"]
    assert warm_torchrun(["torchrun", "--nproc-per-node", "2", "-m", "domino", "pretrain"], on) == warm
    assert warm_torchrun([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "domino",
                          "pretrain"], on) == warm
    for command in (["torchrun", "--nproc-per-node", "2", "train.py", "-m", "domino"],  # a script of its own
                    ["torchrun", "--no-python", "-m", "domino"], ["python", "-m", "domino", "pretrain"]):
        assert warm_torchrun(command, on) == command
    cold = ["torchrun", "-m", "domino", "pretrain"]
    assert warm_torchrun(cold, {}) == cold and warm_torchrun(cold, {"DOMINO_WARM_RANKS": "0"}) == cold  # opt-in


def test_the_ranks_are_forks_of_the_warm_agent_and_train(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "domino.cli.torchrun", "--standalone", "--nproc-per-node", "2",
                             *ARGS, "--train-iters", "40", "--metrics-file", str(metrics)],
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (metrics.exists() and read_metrics(metrics)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        ranks = children(proc.pid)
        assert len(ranks) == 2 and all(_cmdline(pid) == _cmdline(proc.pid) for pid in ranks), (
            [_cmdline(pid) for pid in ranks], _cmdline(proc.pid))  # forked: no exec of `python -m domino`
        for pid in ranks:  # torchrun's handlers (SignalException) are not inherited: a fresh interpreter's instead
            assert not _caught(pid) & {signal.SIGHUP, signal.SIGQUIT}, _caught(pid)
        assert {signal.SIGHUP, signal.SIGQUIT} <= _caught(proc.pid)  # the agent's own, from torchrun
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert max(r["iteration"] for r in read_metrics(metrics) if "eval" not in r) == 40


def test_a_failing_forked_rank_makes_torchrun_exit_1_with_its_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "domino.cli.torchrun", "--standalone", "--nproc-per-node", "1",
                           *ARGS, "--tensor-model-parallel-size", "1", "--train-iters", "2", "--lr", "nan"], env=child_env(), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr, proc.stderr[-3000:]
    assert "domino pretrain: error: --lr must be a finite number, got nan" in proc.stderr
    assert "exitcode: 2" in proc.stderr  # the rank's own status, as torchrun reports it
