"""Runs a JobSpec on this machine: each node (pod) of the job a local process.

Every node gets exactly the environment the job API's controller injects into its pod
(:meth:`~domino.launch.job_api_base.JobApi.node_env`: the training operator's for a PyTorchJob, the
Trainer torch plugin's for a TrainJob) and runs the container's command, so ``torchrun`` picks up
nodes, node rank and master from ``PET_*`` as it does in the cluster. The one difference: the master's
host name does not resolve here, so the master address is ``127.0.0.1`` and the port a free local one.
The shared volume's mount path is mapped to ``workdir`` in the command and the env.

Restarts follow the operator (kubeflow/trainer release-1.9) and the kubelet (a TrainJob's JobSet recreates
every pod per fault, which this backend counts the same way: one restart per node, failing at the fault
the JobSet's maxRestarts is reached, see :meth:`~domino.launch.job_api_base.JobApi.backoff_limit`):

* ``OnFailure``: the operator gives the pods ``restartPolicy: OnFailure`` (``pkg/core/pod.go``
  ``SetRestartPolicy``), so the kubelet restarts a failed container in place, keeping the pod's address.
  Every restart counts: the job Fails once the restarts summed over all pods reach ``backoffLimit``
  (``pkg/core/job.go`` ``PastBackoffLimit``: ``sum >= limit``; any restart when the limit is 0).
* ``ExitCode``: the pods have ``restartPolicy: Never``; the operator deletes and recreates a pod whose
  ``pytorch`` container exited with 128-255 (``pkg/controller.v1/common/pod.go``,
  ``IsRetryableExitCode``), a fresh pod whose restart count starts at 0, so these restarts are never
  counted; exit codes 1-127 Fail the job at once.

When one replica fails, its peers fail too in a real job (their collectives lose the rank; torchrun
exits non-zero) and each is restarted by its own kubelet, one restart each. Left alone, though, a
peer may first rejoin the dying incarnation's rendezvous store and hang until a long timeout; this
backend therefore stops the peers at once and restarts every replica together after
``restart_delay_s``, counting one restart per replica (under ``OnFailure``), as the cluster would.
In a cluster with ``ExitCode`` the peers exit 1, which is permanent: prefer ``OnFailure``.

The job Succeeds when every replica has exited 0; ``active_deadline_seconds`` and ``timeout_s`` stop it.
:meth:`LocalLauncher.preempt` does what Kueue's preemption does to a running job (suspend it, delete every
pod with its grace period) and the run ends ``Suspended``; Kueue re-admits a job with the pods it had, so a
run continued on other pods is another submission (:mod:`domino.launch.parallel_layout`).
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
from domino.launch.outcome import JobResult, LaunchInterrupted, interrupt_on_signals
from domino.launch.parallel_layout import derive_layout
from domino.launch.processes import alive, container_exit_code, process_tree, signal_tree
from domino.launch.job_api import DEFAULT_JOB_API, JobApi, job_api
from domino.launch.render import container_command, relay_prefix
from domino.launch.spec import JobSpec, LaunchSpecError


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def inherited_env() -> Dict[str, str]:
    """This process's environment minus launch variables a pod would not have (e.g. when the local
    backend itself runs under torchrun)."""
    drop = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC_")}


def map_path(text: str, mount_path: str, workdir: str) -> str:
    """Replaces the mount path (as a whole path prefix) in ``text`` by ``workdir``."""
    return re.sub(re.escape(mount_path.rstrip("/")) + r"(?=/|$|\s|,|:)", workdir.replace("\\", "\\\\"), text)


def local_command(spec: JobSpec, name: str, workdir: str) -> List[str]:
    """The container command with ``torchrun`` and ``python`` -> this interpreter (its ``torch.distributed.run``),
    the signal relay's command included."""
    command = [map_path(arg, spec.mount_path, workdir) for arg in container_command(spec, name)]
    relay = relay_prefix(spec)
    if command[:len(relay)] == relay:
        return [sys.executable, *relay[1:], *_this_interpreter(command[len(relay):])]
    return _this_interpreter(command)


def _this_interpreter(command: List[str]) -> List[str]:
    if command[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return command


def retryable(restart_policy: str, code: int) -> bool:
    """Whether the operator restarts a replica that exited with ``code`` under ``restart_policy``."""
    if restart_policy == "ExitCode":
        return 128 <= code <= 255
    return code != 0


def _kill(procs: List[subprocess.Popen], grace_s: float) -> List[int]:
    """SIGTERM every replica (torchrun forwards it to its ranks), then SIGKILL every process of the
    replicas' trees that is left after ``grace_s``, like a pod deleted with a grace period (the kubelet's
    ``killContainer`` asks the runtime to stop the container with that timeout: the signal to its main
    process, SIGKILL when the timeout ends; kubernetes ``pkg/kubelet/kuberuntime/kuberuntime_container.go``).
    Returns the processes that were still running at the end of the grace period."""
    trees = {proc.pid: process_tree(proc.pid) for proc in procs if proc.poll() is None}
    for proc in procs:
        if proc.pid in trees:
            signal_tree(trees[proc.pid][:1], signal.SIGTERM)
    end = time.monotonic() + grace_s
    overdue: List[int] = []
    for proc in procs:
        try:
            proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        left = alive(trees.get(proc.pid, []))
        overdue += left
        signal_tree(left, signal.SIGKILL)
        proc.wait()
    return overdue


class LocalLauncher:
    """Executes a JobSpec's nodes as local processes (see the module docstring).

    Args:
        api: the job API whose controller's environment the nodes get (default: PyTorchJob).
        log: receives status messages and the Master's output lines.
        poll_s: how often the replicas are checked.
        log_tail_lines: output lines kept for the result.
        kill_grace_s: time between SIGTERM and SIGKILL when stopping replicas (default: the spec's
            ``termination_grace_period_s``, as the kubelet gives a deleted pod; the replicas' torchrun gets
            its shutdown timeout from it, :func:`domino.launch.defaults.shutdown_timeout_s`).
        restart_delay_s: wait before a failed replica is restarted (stands for the kubelet's back-off, which
            starts at 10 s and doubles).

    Attributes:
        processes: replica name -> its current process (a restart replaces it).
    """

    def __init__(self, api: Optional[JobApi] = None, log: Callable[[str], None] = print, poll_s: float = 0.1,
                 log_tail_lines: int = 50, kill_grace_s: Optional[float] = None,
                 restart_delay_s: float = 2.0) -> None:
        self.api = api or job_api(DEFAULT_JOB_API)
        self.log, self.poll_s, self.log_tail_lines, self.kill_grace_s = log, poll_s, log_tail_lines, kill_grace_s
        self.grace_s = kill_grace_s if kill_grace_s is not None else 0.0  # per run: run() sets the spec's
        self.restart_delay_s = restart_delay_s
        self.processes: Dict[str, subprocess.Popen] = {}
        self._preempted = threading.Event()

    def run(self, spec: JobSpec, run_id: Optional[str] = None, timeout_s: Optional[float] = None,
            workdir: Optional[str] = None) -> JobResult:
        """Runs all replicas until Succeeded or Failed; returns the result."""
        spec.validate()
        self.api.check(spec)
        self.grace_s = self.kill_grace_s if self.kill_grace_s is not None else spec.termination_grace_period_s
        # No API server here to read a Secret from: a required reference cannot be met (optional ones are left
        # unset, as the kubelet leaves them when the Secret is missing).
        if any(":" in ref for ref in spec.secret_env.values()) or spec.env_from_secrets:
            raise LaunchSpecError("--env-secret SECRET:KEY/--env-from-secret read Kubernetes Secrets, which the local "
                                  "backend does not have; run on a cluster, or give the values another way")
        if spec.parallel_layout == "derive" and spec.command is None:
            self.log(f"parallel layout derived for {derive_layout(spec).why}")
        run_id = run_id or naming.new_run_id()
        name = naming.job_name(spec.name, run_id, spec.nodes)
        workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix=f"domino-{name}-"))
        Path(workdir, "logs").mkdir(parents=True, exist_ok=True)
        limits = [t for t in (timeout_s, spec.active_deadline_seconds) if t is not None]
        deadline = time.monotonic() + min(limits) if limits else None
        tail: Deque[str] = collections.deque(maxlen=self.log_tail_lines)
        self.log(f"local {self.api.kind} {name}: {spec.nodes} node(s) x {spec.nproc_per_node} process(es), "
                 f"{spec.mount_path} -> {workdir}")
        port = free_port()  # the master's port stays the same across restarts, as its Service's does
        replicas = self.api.node_names(name, spec.nodes)
        self.processes = {}
        self._preempted.clear()
        with interrupt_on_signals() as shield:
            try:
                for rank, replica in enumerate(replicas):
                    self._start(spec, name, workdir, tail, rank, replica, port)
                outcome = self._supervise(spec, name, replicas, workdir, tail, port, deadline)
                if outcome is None:
                    why = "Timeout" if timeout_s is not None and min(limits) == timeout_s else "DeadlineExceeded"
                    outcome = JobResult(name, False, "Failed", f"{why}: the job did not finish within "
                                        f"{min(limits):g} s", [], None)
                _kill(list(self.processes.values()), self.grace_s)
                self._drain(replicas[0])
                outcome.log_tail = list(tail)
                return outcome
            except LaunchInterrupted as error:
                return JobResult(name, False, "Failed", f"Interrupted: the launcher {error}", list(tail), None)
            finally:
                shield()
                _kill(list(self.processes.values()), self.grace_s)

    def _supervise(self, spec: JobSpec, name: str, replicas: List[str], workdir: str, tail: Deque[str], port: int,
                   deadline: Optional[float]) -> Optional[JobResult]:
        """Restarts the replicas per the restart policy; the result, or None at the deadline."""
        limit = self.api.backoff_limit(spec)
        restarts = 0  # container restarts summed over replicas (OnFailure), as PastBackoffLimit counts them
        while deadline is None or time.monotonic() < deadline:
            if self._preempted.is_set():
                return self._suspend(name, replicas[0])
            failed = next(((replica, container_exit_code(proc.poll())) for replica, proc in self.processes.items()
                           if proc.poll() not in (None, 0)), None)
            if failed is None:
                if all(p.poll() == 0 for p in self.processes.values()):
                    self.log(f"[{name}] Succeeded")
                    return JobResult(name, True, "Succeeded", "", [], 0)
                time.sleep(self.poll_s)
                continue
            replica, code = failed
            if not retryable(spec.restart_policy, code):
                self.log(f"[{name}] Failed: {replica} exited with code {code}")
                return JobResult(name, False, "Failed", f"PermanentFailure: replica {replica} exited with code "
                                 f"{code} (exit codes 1-127 are permanent under ExitCode)", [], code)
            # The peers lose the rank and fail too; stop them now instead of waiting (module docstring).
            peers = [r for r, p in self.processes.items() if r != replica and p.poll() is None]
            _kill([self.processes[r] for r in peers], self.grace_s)
            if spec.restart_policy == "OnFailure":
                restarts += 1 + len(peers)
                if restarts >= limit:
                    self.log(f"[{name}] Failed: {replica} exited with code {code}")
                    return JobResult(name, False, "Failed", f"BackoffLimitExceeded: replica {replica} exited with "
                                     f"code {code}; {restarts} restart(s) reached backoffLimit {limit}", [], code)
            self.log(f"[{name}] Restarting: {replica} exited with code {code}, its peers fail with it "
                     + (f"(restarts {restarts}, backoffLimit {limit})" if spec.restart_policy == "OnFailure"
                        else "(pods recreated; not counted under ExitCode)"))
            time.sleep(self.restart_delay_s)
            self._drain(replicas[0])
            for rank, name_ in enumerate(replicas):
                if self.processes[name_].poll() != 0:
                    self._start(spec, name, workdir, tail, rank, name_, port)
        return None

    def _start(self, spec: JobSpec, name: str, workdir: str, tail: Deque[str], rank: int, replica: str,
               port: int) -> None:
        command = local_command(spec, name, workdir)
        env = {**inherited_env(), **{k: map_path(v, spec.mount_path, workdir)
                                for k, v in self.api.node_env(spec, name, rank, port).items()}}
        out = subprocess.PIPE if rank == 0 else open(Path(workdir, "logs", f"{replica}.log"), "ab")
        proc = subprocess.Popen(command, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # own process group: kill torchrun and its workers
        if rank == 0:
            proc.pump = threading.Thread(target=self._pump, args=(proc, tail), daemon=True)
            proc.pump.start()
        else:
            out.close()
        self.processes[replica] = proc

    def preempt(self) -> None:
        """Preempts the running job as Kueue does: the job is suspended and every pod deleted with its grace
        period; :meth:`run` then returns a ``Suspended`` result instead of restarting anything.

        Kueue evicts the job's Workload and suspends the job (kubernetes-sigs/kueue v0.19.2
        ``pkg/controller/jobframework/reconciler.go``: an ``Evicted`` Workload -> ``stopJob`` -> ``job.Suspend()``,
        ``runPolicy.suspend`` for a PyTorchJob; a TrainJob's own ``Stop`` sets ``spec.suspend``); the training
        operator then deletes every pod of the suspended job (kubeflow/training-operator v1.9.0
        ``pkg/controller.v1/common/job.go``: ``IsJobSuspended`` -> ``CleanUpResources`` ->
        ``DeletePodsAndServices``), and the kubelet stops each pod's containers: SIGTERM, the pod's
        ``terminationGracePeriodSeconds``, then SIGKILL. Safe to call from another thread.
        """
        self._preempted.set()

    def _suspend(self, name: str, master: str) -> JobResult:
        """Deletes every pod with the grace period (see :meth:`preempt`) and reports the job Suspended."""
        started = time.monotonic()
        self.log(f"[{name}] Suspended: preempted; deleting every pod with a {self.grace_s:g} s grace period")
        overdue = _kill(list(self.processes.values()), self.grace_s)
        took = time.monotonic() - started
        self._drain(master)
        how = (f"{len(overdue)} process(es) still ran at its end and were SIGKILLed" if overdue
               else f"every pod exited within it, after {took:.1f} s")
        self.log(f"[{name}] Suspended: pods gone; {how}")
        return JobResult(name, False, "Suspended", f"Preempted: the job was suspended and its pods deleted with a "
                         f"{self.grace_s:g} s grace period; {how}", [], container_exit_code(self.processes[master].poll()))

    def kill_replica(self, replica: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to every process of ``replica`` at once: what losing its pod (its node) does."""
        signal_tree(process_tree(self.processes[replica].pid), sig)

    def _drain(self, master: str) -> None:
        """Lets the Master's output reach the tail (its last lines belong in the result)."""
        pump = getattr(self.processes.get(master), "pump", None)
        if pump is not None:
            pump.join(self.grace_s)

    def _pump(self, proc: subprocess.Popen, tail: Deque[str]) -> None:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            tail.append(line)
            self.log(line)
