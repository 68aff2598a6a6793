"""Recovery time of one failed step: ``--inprocess-restart``, a torchrun worker restart, and a new torchrun job.

Rank 1 of a TP 2 run of the ``tiny`` preset raises in its step 5 (``DOMINO_FAULT_INJECT=raise-in-step@5:1``;
checkpoints every 2 iterations). Recovery is read from the goodput ledger: from iteration 4's ``progress`` record
(the last step before the fault; the save of iteration 4 follows it) to the first step after the fault. For the
new job it is the failed job's remainder (iteration 4's record to the job's exit) plus the new job's launch to its
first step. The worker restart is ``torchrun --max-restarts 1`` without the flag: torchrun starts both ranks again
and they resume. Prints one JSON line of seconds per trial.

    python benchmarks/recovery.py [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from domino.goodput.ledger import read_events

FAULT = {"DOMINO_FAULT_INJECT": "raise-in-step@5:1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(save: str, extra=(), env=None, max_restarts: int = 0):
    command = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", str(max_restarts), "--nproc-per-node",
               "2",
               "--master-addr", "127.0.0.1", "--master-port", str(_port()), "-m", "domino", "pretrain",
               "--preset", "tiny", "--mock-data", "--vocab-size", "256", "--num-workers", "0", "--seed", "7",
               "--log-interval", "1", "--tensor-model-parallel-size", "2", "--train-iters", "8",
               "--save-interval", "2", "--save", save, "--load", save, "--eval-iters", "0", "--eval-interval", "0",
               *extra]
    job_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    started = time.time()
    proc = subprocess.run(command, env=job_env, capture_output=True, text=True, timeout=300)
    return proc, started, time.time()


def _iteration_4(events) -> float:
    return max(e["t"] for e in events if e["event"] == "progress" and e["iteration"] == 4)


def _first_step_after(events, t: float) -> float:
    return min(e["t"] for e in events if e["event"] == "first_step" and e["t"] > t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    trials = parser.parse_args().trials
    out = {"inprocess_s": [], "worker_restart_s": [], "new_job_s": []}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(trials):
            save = os.path.join(root, "inprocess")
            proc, _, _ = _job(save, ["--inprocess-restart"], FAULT)
            assert proc.returncode == 0, proc.stderr[-3000:]
            events = read_events(save)
            before = _iteration_4(events)
            out["inprocess_s"].append(round(_first_step_after(events, before) - before, 2))
            shutil.rmtree(save)
            save = os.path.join(root, "worker_restart")
            proc, _, _ = _job(save, env=FAULT, max_restarts=1)
            assert proc.returncode == 0, proc.stderr[-3000:]
            events = read_events(save)
            before = _iteration_4(events)
            out["worker_restart_s"].append(round(_first_step_after(events, before) - before, 2))
            shutil.rmtree(save)
            save = os.path.join(root, "new_job")
            proc, _, failed_exit = _job(save, env=FAULT)
            assert proc.returncode != 0
            before = _iteration_4(read_events(save))
            proc, launched, _ = _job(save)
            assert proc.returncode == 0, proc.stderr[-3000:]
            out["new_job_s"].append(round(failed_exit - before + _first_step_after(read_events(save), launched)
                                          - launched, 2))
            shutil.rmtree(save)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
