"""Helpers for training tests: run `domino pretrain` processes and read their metrics files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from distributed_helpers import free_port
from train.pretrain_zygote import can_serve, shared_server

TINY = ["--preset", "tiny", "--log-interval", "1", "--num-workers", "0", "--seed", "7"]


def pretrain_command(args: List[str], nproc: int = 1) -> List[str]:
    """`domino pretrain ARGS` alone, or under torchrun with ``nproc`` local processes."""
    if nproc == 1:
        return [sys.executable, "-m", "domino", "pretrain", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", "domino", "pretrain", *args]


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The test's environment for a training child: CPU DeepSpeed, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def run_pretrain(args: List[str], nproc: int = 1, timeout: float = 300, check: bool = True,
                 env: Optional[Dict[str, str]] = None, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Runs `domino pretrain` to completion; on ``check`` a failure shows the child's output.

    The ranks are forked from a warm server (tests/train/pretrain_zygote.py: the same processes and exit
    status without 3-5 s of imports per job). ``torchrun=True``, or an environment that would change what the
    server imported, runs the command itself: `python -m domino`, under torchrun for several processes.
    """
    command, job_env = pretrain_command(args, nproc), child_env(env)
    server = None if torchrun else shared_server(child_env())
    if server is not None and can_serve(job_env, server.env):
        proc = server.run(command, args, nproc, job_env, timeout)
    else:
        proc = subprocess.run(command, env=job_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"domino pretrain failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(path: Path) -> List[dict]:
    """The JSON records of a metrics file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(path: Path) -> Dict[int, float]:
    """``{iteration: lm_loss}`` of the training records."""
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(path) if "eval" not in r}


def rank_of(pid: int) -> int:
    """The ``RANK`` torchrun gave the worker process ``pid`` (from its environment in /proc)."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        env = dict(item.split(b"=", 1) for item in environ.read().split(b"\0") if b"=" in item)
    return int(env[b"RANK"])
