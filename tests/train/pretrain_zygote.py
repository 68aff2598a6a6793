"""Runs `domino pretrain` jobs as processes forked from one warm server, as torchrun would run them.

A fresh `python -m domino pretrain` spends about 3 s of the CI machine importing torch and DeepSpeed before it
trains a tiny model for half a second, and torchrun spends 2 s more importing itself; the suite starts about a
hundred such jobs. The server imports once (the same modules :class:`checkpoint.forked_ranks.Zygote` warms) and
forks each job's ranks. A rank is a real process, forked before anything is initialised, that runs the real
command line as ``python -m domino`` does (``main()`` reading ``sys.argv``, so it leaves the way the real
process leaves), with the environment, working directory and stdin (``/dev/null``) the caller's subprocess
would get.

One process: the environment as given (no ``RANK``), the status the process exits with. Several: each rank gets
the variables torchrun's agent sets (torch 2.13 ``distributed/elastic/agent/server/local_elastic_agent.py``
``_start_workers``; no agent store: rank 0 hosts the rendezvous store, as with a plain ``env://`` init), and the
job is watched as torchrun watches it (``distributed/run.py``: ``--monitor-interval`` 0.1 s, ``--max-restarts``
0): when a rank fails, the others get SIGTERM and, 30 s later, SIGKILL (``LocalElasticAgent._shutdown``,
``elastic/multiprocessing/api.py`` ``SubprocessContext._close``), and the job's status is 1 (``ChildFailedError``,
asserted in tests/launch/test_torchrun_exit_codes.py). What stays torchrun's own (its messages, its exit on
SIGTERM, restarts) is tested through torchrun itself.

A request whose environment would change what the server already imported (``PYTHONPATH``, thread counts, the
accelerator) cannot be served this way: :func:`can_serve` says so, and the caller starts a fresh process.

Protocol: one JSON request a line on stdin, one JSON reply a line on stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
SERVER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Read when the server imports torch, DeepSpeed and domino: a request must agree with the server on these.
IMPORT_TIME = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "OMP_NUM_THREADS",
               "MKL_NUM_THREADS", "DS_ACCELERATOR", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE")
MONITOR_INTERVAL_S, TERMINATE_GRACE_S = 0.1, 30.0  # torchrun's --monitor-interval and SIGTERM-to-SIGKILL grace


def can_serve(env: Dict[str, str], server_env: Dict[str, str]) -> bool:
    """Whether a job with ``env`` behaves the same forked from a server started with ``server_env``."""
    return all(env.get(name) == server_env.get(name) for name in IMPORT_TIME)


class Server:
    """The pytest side: starts the server on first use, sends it jobs, stops it when pytest exits."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._log = Path(tempfile.mkstemp(prefix="pretrain-zygote-", suffix=".log")[1])
        self.env: Dict[str, str] = {}

    def start(self, env: Dict[str, str]) -> None:
        """Starts the server with ``env`` (what it imports with); a no-op while it runs."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self.env = dict(env)
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen([sys.executable, __file__], env=self.env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
        atexit.register(self.stop)

    def stop(self) -> None:
        """Ends the server (its stdin closes; it exits after the job in hand)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)

    def run(self, command: List[str], args: List[str], nproc: int, env: Dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        """Runs ``domino pretrain ARGS`` on ``nproc`` forked ranks; returns what ``subprocess.run`` would.

        ``stdout``/``stderr`` hold every rank's, rank by rank (torchrun's workers share the launcher's).

        Raises:
            subprocess.TimeoutExpired: when the job ran past ``timeout`` seconds (its ranks are killed).
        """
        with tempfile.TemporaryDirectory(prefix="pretrain-job-") as out:
            request = {"args": args, "nproc": nproc, "env": env, "cwd": os.getcwd(), "timeout": timeout, "out": out}
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the pretrain zygote died:\n{self._log.read_text(errors='replace')[-4000:]}")
            reply = json.loads(line)
            stdout, stderr = ("".join((Path(out) / f"rank{r}.{kind}").read_text(errors="replace")
                                      for r in range(nproc)) for kind in ("out", "err"))
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(command, reply["returncode"], stdout, stderr)


_SHARED: List[Server] = []


def shared_server(env: Dict[str, str]) -> Server:
    """The session's server, started with ``env`` on first use."""
    if not _SHARED:
        _SHARED.append(Server())
    _SHARED[0].start(env)
    return _SHARED[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_env(rank: int, nproc: int, port: int) -> Dict[str, str]:
    """What torchrun's agent adds to a worker's environment on one node without restarts."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _become_rank(request: dict, rank: int, port: Optional[int]) -> None:
    """In the forked child: takes the job's environment and streams, then runs ``python -m domino pretrain``.

    Never returns: ``main()`` leaves the process, and an error propagates out of the server's frames to
    Python's own exit (traceback, status 1), as in a fresh process.
    """
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, f"{request['out']}/rank{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, f"{request['out']}/rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"], **(_torchrun_env(rank, request["nproc"], port) if port else {}))
    os.chdir(request["cwd"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import domino.__main__
    from domino.cli.main import main

    sys.argv = [domino.__main__.__file__, "pretrain", *request["args"]]
    sys.path[:] = [request["cwd"], *_SCRIPT_PATH[1:]]  # as `python -m` puts the working directory first
    main()
    sys.exit(0)


def _watch(pids: List[int], timeout: float) -> dict:
    """Waits for the ranks as torchrun's agent does; kills them all after ``timeout``."""
    status: Dict[int, int] = {}
    deadline, terminated_at = time.monotonic() + timeout, None
    timed_out = False
    while len(status) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[rank] = os.waitstatus_to_exitcode(code)
        now = time.monotonic()
        failed = any(code != 0 for code in status.values())
        if len(pids) > 1 and failed and terminated_at is None and len(status) < len(pids):
            terminated_at = now
            _signal_rest(pids, status, signal.SIGTERM)
        if terminated_at is not None and now > terminated_at + TERMINATE_GRACE_S:
            _signal_rest(pids, status, signal.SIGKILL)
        if now > deadline and not timed_out:
            timed_out = True
            _signal_rest(pids, status, signal.SIGKILL)
        time.sleep(MONITOR_INTERVAL_S)
    codes = [status[r] for r in range(len(pids))]
    returncode = codes[0] if len(pids) == 1 else int(any(codes))
    return {"returncode": returncode, "codes": codes, "timed_out": timed_out}


def _signal_rest(pids: List[int], status: Dict[int, int], sig: int) -> None:
    for rank, pid in enumerate(pids):
        if rank not in status:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


_SCRIPT_PATH = list(sys.path)  # before serve() adds the test helpers'


def serve() -> None:
    """The server loop: one job at a time, until stdin closes."""
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from checkpoint.forked_ranks import warm_imports

    warm_imports()
    for line in sys.stdin:
        request = json.loads(line)
        nproc = request["nproc"]
        port = _free_port() if nproc > 1 else None
        pids = []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:
                _become_rank(request, rank, port)
            pids.append(pid)
        sys.stdout.write(json.dumps(_watch(pids, request["timeout"])) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
