"""Runs a JobSpec on this machine: each replica (Master + Workers) a local process.

Every replica gets exactly the environment the training operator injects into its pod (see
:func:`replica_env`) and runs the container's command, so ``torchrun`` picks up nodes, node rank and
master from ``PET_*`` as it does in the cluster. The one difference: ``<job>-master-0`` does not
resolve here, so the master address is ``127.0.0.1`` and the port a free local one instead of 23456.
The shared volume's mount path is mapped to ``workdir`` in the command and the env.

Failure semantics follow the operator: a replica that fails ends the attempt (all replicas are
killed); the whole group is restarted while the restart policy allows it (OnFailure: any non-zero
exit; ExitCode: exit codes 128-255, 1-127 being permanent) and fewer than ``backoff_limit`` restarts
happened; otherwise the job Failed. ``active_deadline_seconds`` and ``timeout_s`` stop it too.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional

from domino.launch import naming
from domino.launch.api import JobResult, LaunchInterrupted, interrupt_on_signals
from domino.launch.render import container_command
from domino.launch.spec import JobSpec


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replica_env(spec: JobSpec, name: str, node_rank: int, master_port: int) -> Dict[str, str]:
    """The variables the operator injects into replica ``node_rank`` (0 = Master), plus the spec's env."""
    nproc = spec.nproc_per_node
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(spec.nodes * nproc if isinstance(nproc, int) else spec.nodes),
        "RANK": str(node_rank),
        "PET_NNODES": str(spec.nodes),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
        "DOMINO_JOB_NAME": name,
    }
    env.update({k: str(v) for k, v in spec.env.items()})
    return env


def inherited_env() -> Dict[str, str]:
    """This process's environment minus launch variables a pod would not have (e.g. when the local
    backend itself runs under torchrun)."""
    drop = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC_")}


def map_path(text: str, mount_path: str, workdir: str) -> str:
    """Replaces the mount path (as a whole path prefix) in ``text`` by ``workdir``."""
    return re.sub(re.escape(mount_path.rstrip("/")) + r"(?=/|$|\s|,|:)", workdir.replace("\\", "\\\\"), text)


def local_command(spec: JobSpec, name: str, workdir: str) -> List[str]:
    """The container command with ``torchrun`` -> this interpreter's ``torch.distributed.run``."""
    command = [map_path(arg, spec.mount_path, workdir) for arg in container_command(spec, name)]
    if command[0] == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    elif command[0] in ("python", "python3"):
        command[0] = sys.executable
    return command


def retryable(restart_policy: str, code: int) -> bool:
    """Whether the operator restarts a replica that exited with ``code`` under ``restart_policy``."""
    if restart_policy == "ExitCode":
        return 128 <= code <= 255
    return code != 0


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128 + N, like a container


def _kill(procs: List[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every replica's process group, then SIGKILL what is left after ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    end = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


class LocalLauncher:
    """Executes a JobSpec's replicas as local processes (see the module docstring).

    Args:
        log: receives status messages and the Master's output lines.
        poll_s: how often the replicas are checked.
        log_tail_lines: output lines kept for the result.
        kill_grace_s: time between SIGTERM and SIGKILL when stopping replicas.
    """

    def __init__(self, log: Callable[[str], None] = print, poll_s: float = 0.1, log_tail_lines: int = 50,
                 kill_grace_s: float = 5.0) -> None:
        self.log, self.poll_s, self.log_tail_lines, self.kill_grace_s = log, poll_s, log_tail_lines, kill_grace_s

    def run(self, spec: JobSpec, run_id: Optional[str] = None, timeout_s: Optional[float] = None,
            workdir: Optional[str] = None) -> JobResult:
        """Runs all replicas until Succeeded or Failed; returns the result."""
        spec.validate()
        run_id = run_id or naming.new_run_id()
        name = naming.job_name(spec.name, run_id, spec.nodes)
        workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix=f"domino-{name}-"))
        Path(workdir, "logs").mkdir(parents=True, exist_ok=True)
        limits = [t for t in (timeout_s, spec.active_deadline_seconds) if t is not None]
        deadline = time.monotonic() + min(limits) if limits else None
        tail: Deque[str] = collections.deque(maxlen=self.log_tail_lines)
        self.log(f"local job {name}: {spec.nodes} replica(s) x {spec.nproc_per_node} process(es), "
                 f"{spec.mount_path} -> {workdir}")
        restarts = 0
        procs: List[subprocess.Popen] = []
        with interrupt_on_signals() as shield:
            try:
                while True:
                    procs = self._start(spec, name, workdir, tail)
                    code, failed = self._wait(procs, deadline)
                    _kill(procs, self.kill_grace_s)
                    procs[0].pump.join(self.kill_grace_s)  # the master's last lines belong in the result
                    if code is None:
                        why = "Timeout" if timeout_s is not None and min(limits) == timeout_s else "DeadlineExceeded"
                        return JobResult(name, False, "Failed", f"{why}: the job did not finish within "
                                         f"{min(limits):g} s", list(tail), None)
                    if failed is None:
                        self.log(f"[{name}] Succeeded")
                        return JobResult(name, True, "Succeeded", "", list(tail), 0)
                    limit = spec.backoff_limit if spec.backoff_limit is not None else 6
                    if retryable(spec.restart_policy, code) and restarts < limit:
                        restarts += 1
                        self.log(f"[{name}] Restarting: {failed} exited with code {code} "
                                 f"(restart {restarts} of {limit})")
                        continue
                    why = "BackoffLimitExceeded" if retryable(spec.restart_policy, code) else "PermanentFailure"
                    self.log(f"[{name}] Failed: {failed} exited with code {code}")
                    return JobResult(name, False, "Failed", f"{why}: replica {failed} exited with code {code} "
                                     f"after {restarts} restart(s)", list(tail), code)
            except LaunchInterrupted as error:
                return JobResult(name, False, "Failed", f"Interrupted: the launcher {error}", list(tail), None)
            finally:
                shield()
                _kill(procs, self.kill_grace_s)

    def _start(self, spec: JobSpec, name: str, workdir: str, tail: Deque[str]) -> List[subprocess.Popen]:
        port = free_port()
        command = local_command(spec, name, workdir)
        procs = []
        for rank in range(spec.nodes):
            replica = f"{name}-master-0" if rank == 0 else f"{name}-worker-{rank - 1}"
            env = {**inherited_env(), **{k: map_path(v, spec.mount_path, workdir)
                                    for k, v in replica_env(spec, name, rank, port).items()}}
            if rank == 0:
                out = subprocess.PIPE
            else:
                out = open(Path(workdir, "logs", f"{replica}.log"), "ab")
            proc = subprocess.Popen(command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # own process group: kill torchrun and its workers
            proc.replica = replica
            if rank == 0:
                proc.pump = threading.Thread(target=self._pump, args=(proc, tail), daemon=True)
                proc.pump.start()
            else:
                out.close()
            procs.append(proc)
        return procs

    def _pump(self, proc: subprocess.Popen, tail: Deque[str]) -> None:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            tail.append(line)
            self.log(line)

    def _wait(self, procs: List[subprocess.Popen], deadline: Optional[float]):
        """Waits until all succeed (code 0, None), one fails (code, replica) or the deadline (None, None)."""
        while True:
            codes = [p.poll() for p in procs]
            for proc, code in zip(procs, codes):
                if code not in (None, 0):
                    return _exit_code(code), proc.replica
            if all(code == 0 for code in codes):
                return 0, None
            if deadline is not None and time.monotonic() >= deadline:
                return None, None
            time.sleep(self.poll_s)
