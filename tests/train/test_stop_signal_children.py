"""A stop signal that reaches a rank's DataLoader workers never costs the save.

Real torchrun (torch 2.13) with two ranks and the default ``--num-workers`` (2 loader workers on each rank that
reads data), given a 6 s shutdown timeout, signalled the three ways a job is stopped:

* ``torchrun``: torchrun itself (TP 2), which SIGTERMs each rank's process group (``os.killpg`` in torch's
  ``subprocess_handler.py``; each rank leads a session of its own), the loader workers included, and SIGKILLs
  what is left 6 s later;
* ``everyone``: every process of the job at once (TP 2; Slurm's ``scancel``, a cgroup-wide kill), here while the
  ranks evaluate every other step and an asynchronous save may be in flight;
* ``ranks``: the ranks alone (the signal relay's way, :mod:`domino.launch.signal_relay`; DP 2, so both ranks have
  workers, and torchrun's own SIGTERM of the slower rank's group follows the first rank's exit). The workers get
  no signal from the relay, so this case passed before :mod:`domino.child_signals` too: it is the control.

Without :mod:`domino.child_signals` the first two fail: the workers die of the SIGTERM, the rank raises
"DataLoader worker (pid N) is killed by signal: Terminated" and no checkpoint is written after the signal
(checked). ``tests/test_child_signals.py`` covers the workers' own behaviour.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from domino.launch.processes import alive, children, process_tree, signal_tree
from train.train_helpers import child_env, pretrain_command

ARGS = ["--preset", "tiny", "--seed", "7", "--mock-data", "--vocab-size", "256", "--train-iters", "100000", "--log-interval", "1000", "--save-interval", "3", "--exit-signal-handler"]
EXTRA = {"ranks": ["--tensor-model-parallel-size", "1"], "torchrun": ["--tensor-model-parallel-size", "2"],
         "everyone": ["--tensor-model-parallel-size", "2", "--eval-interval", "2", "--eval-iters", "2", "--async-save"]}


def _latest(save) -> int:
    """The iteration ``latest`` names (0 before the first save)."""
    latest = save / "latest"
    return int(latest.read_text().strip().rsplit("_", 1)[1]) if latest.exists() else 0


@pytest.mark.parametrize("who", ["ranks", "torchrun", "everyone"])
def test_a_stop_signal_that_reaches_the_loader_workers_still_saves_at_the_next_step(tmp_path, who):
    save = tmp_path / "ckpt"
    args = [*ARGS, *EXTRA[who], "--save", str(save)]
    if who != "everyone":
        args += ["--eval-iters", "0", "--eval-interval", "0"]
    proc = subprocess.Popen(pretrain_command(args, nproc=2), env=child_env({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "6"}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while _latest(save) < 3:  # training steps, and saving
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        tree = process_tree(proc.pid)
        ranks = children(proc.pid)
        workers = [pid for rank in ranks for pid in children(rank)]
        assert len(ranks) == 2 and len(workers) in (2, 4), (ranks, workers)  # 2 loader workers a data-reading rank
        signalled_at = _latest(save)
        if who == "ranks":
            signal_tree(ranks, signal.SIGTERM)
        elif who == "torchrun":
            proc.send_signal(signal.SIGTERM)
        else:
            signal_tree(tree, signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        signal_tree(process_tree(proc.pid), signal.SIGKILL)
        proc.wait()
    assert "killed by signal" not in output, output[-3000:]
    assert "[rank 0] WARNING domino.train.trainer: SIGTERM: saving at iteration" in output, output[-3000:]
    assert "SIGTERM: checkpoint" in output and "durable" in output, output[-3000:]
    assert _latest(save) > signalled_at  # the save after the signal is the newest checkpoint
    assert not list(save.glob(".tmp-*"))
    deadline = time.monotonic() + 2  # torch's own watchdog would notice only after up to 5 s
    while alive(workers):  # the workers end with their rank (the kernel's parent-death signal)
        assert time.monotonic() < deadline, f"loader workers {alive(workers)} outlived their ranks"
        time.sleep(0.1)

