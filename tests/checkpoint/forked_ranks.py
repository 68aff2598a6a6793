"""Runs ``domino pretrain`` as real multi-rank jobs forked from one warm process, so a test can afford many.

Starting a rank costs seconds of imports (torch, DeepSpeed, domino) on the CI machine; a job that a test kills
and restarts several times would spend most of its time importing. :class:`Zygote` imports once, then forks
each job's ranks (real processes with their own gloo process group, exactly the environment torchrun gives
them: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) and runs the ``domino`` command line
in each. Nothing is initialised in the zygote before it forks (no process group, no threads of torch's).

Run as a script by a test: ``python forked_ranks.py SCENARIO_MODULE:FUNCTION OUT_DIR [ARGS...]`` calls
``FUNCTION(Zygote(), OUT_DIR, *ARGS)`` and writes what it returns to ``OUT_DIR/result.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_imports() -> None:
    """Imports what every rank of ``domino pretrain`` imports, once, without initialising anything."""
    import torch  # noqa: F401  (imported once here, inherited by every fork)
    import deepspeed  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch's optimizers import it on first use: half a second per rank)
    import torch.distributed.checkpoint  # noqa: F401
    # DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose torch.compile decorators import
    # inductor (deepspeed 0.19.8 runtime/zero/utils.py is_zero_supported_optimizer): 2 s per rank.
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import domino.cli.main
    import domino.train.pretrain  # noqa: F401

    domino.cli.main.build_parser()  # imports what the verbs' flags need


class Job:
    """The ranks of one forked ``domino pretrain`` run."""

    def __init__(self, pids: List[int], logs: List[Path]) -> None:
        self.pids, self.logs = pids, logs
        self.status: Dict[int, int] = {}

    def kill(self, rank: int) -> None:
        """Sends SIGKILL to ``rank`` (a no-op when it has already exited)."""
        try:
            os.kill(self.pids[rank], signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = 120.0) -> List[int]:
        """Each rank's exit status (negative: the signal that ended it); kills every rank after ``timeout``."""
        deadline = time.monotonic() + timeout
        while len(self.status) < len(self.pids):
            for rank, pid in enumerate(self.pids):
                if rank not in self.status:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        self.status[rank] = os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                for rank in range(len(self.pids)):
                    if rank not in self.status:
                        self.kill(rank)
                deadline = float("inf")
            time.sleep(0.01)
        return [self.status[r] for r in range(len(self.pids))]

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")


class Zygote:
    """Forks the ranks of ``domino pretrain`` jobs from this warm process."""

    def __init__(self) -> None:
        os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        warm_imports()
        self.runs = 0

    def start(self, args: Sequence[str], world_size: int, log_dir: Path,
              env: Optional[Dict[str, str]] = None) -> Job:
        """Forks ``world_size`` ranks running ``domino pretrain ARGS``; their output goes to ``log_dir``.

        ``env`` is added to each rank's environment; ``DOMINO_TEST_FSIZE_RANK<r>=BYTES`` in it makes rank r
        unable to write files larger than BYTES (``RLIMIT_FSIZE``, SIGXFSZ ignored), as on a full disk.
        """
        self.runs += 1
        log_dir.mkdir(parents=True, exist_ok=True)
        port, pids, logs = _free_port(), [], []
        for rank in range(world_size):
            logs.append(log_dir / f"run{self.runs}-rank{rank}.log")
            pid = os.fork()
            if pid == 0:  # the rank
                self._rank(rank, world_size, port, list(args), logs[-1], env or {})
            pids.append(pid)
        return Job(pids, logs)

    @staticmethod
    def _rank(rank: int, world_size: int, port: int, args: List[str], log: Path, env: Dict[str, str]) -> None:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            limit = env.get(f"DOMINO_TEST_FSIZE_RANK{rank}")
            if limit:  # a full disk, as tests/train/rank_faults.py makes one: writes past it fail with EFBIG
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
            from domino.cli.main import main

            main(["pretrain", *args])
        except SystemExit as leaving:
            code = leaving.code if isinstance(leaving.code, int) else 1
        except BaseException:  # noqa: BLE001  (a rank's failure is its exit status and its log)
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # no atexit handlers of the zygote in a rank

    def run(self, args: Sequence[str], world_size: int, log_dir: Path, timeout: float = 120.0,
            env: Optional[Dict[str, str]] = None) -> List[int]:
        """Runs a job to its end; returns each rank's exit status."""
        return self.start(args, world_size, log_dir, env).wait(timeout)


if __name__ == "__main__":
    target, out = sys.argv[1], Path(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).parent))
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(Zygote(), out, *sys.argv[3:])
    (out / "result.json").write_text(json.dumps(result, indent=1, sort_keys=True))
