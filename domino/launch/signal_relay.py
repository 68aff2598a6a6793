"""The training container's first process: a pod's SIGTERM goes to the ranks themselves, past torchrun.

``python -m domino.launch.signal_relay [--grace-period-s N] torchrun ...`` runs the command and, on SIGTERM or
SIGINT, sends the signal to torchrun's workers (the ranks) instead of torchrun. Why: torchrun forwards a SIGTERM
it receives and SIGKILLs the ranks a fixed 30 s later in a torch without pytorch/pytorch#172596 (torch 2.13
``elastic/agent/server/api.py`` ``SimpleElasticAgent.run`` -> ``_shutdown(timeout=self._shutdown_timeout)``;
before that PR ``PContext.close``'s default ``timeout=30``), which is what the default CUDA base
(``nvcr.io/nvidia/pytorch:25.01-py3``, torch 2.6) ships: a save after SIGTERM that needs longer is lost whatever
the pod's grace period. The kubelet signals only a container's first process (``killContainer`` asks the
runtime to stop the container with the grace period as timeout: the stop signal to its init process, SIGKILL of
the whole container when the timeout ends; kubernetes ``pkg/kubelet/kuberuntime/kuberuntime_container.go``, as
:func:`domino.launch.local_backend._kill` models it), so with the relay there torchrun never receives the signal:
the ranks have the grace period itself.

What follows is torchrun's ordinary failure path. The ranks save at the next step and exit 143
(:mod:`domino.train.preemption`); the first rank's exit makes torchrun SIGTERM the others and SIGKILL them 30 s
later (``SubprocessContext._poll`` -> ``close()``; on every torch: pytorch/pytorch#192815), by when they have
finished the same save's commit, which every rank reaches together. Once the ranks it signalled are gone the
relay signals torchrun too, so that a torchrun given ``--max-restarts`` does not start them again. A signal that
comes before torchrun has started its ranks, or to a command that is not torchrun, goes to the command itself.

As PID 1 it also reaps the orphans re-parented to it, and it exits with the command's code, or 128 + the
signal's number when a relayed signal ended a failing command (143 for SIGTERM: retryable under the operator's
``ExitCode`` restart policy, as a container killed by SIGTERM is). ``--grace-period-s`` is exported to the ranks
as ``DOMINO_GRACE_PERIOD_S``: the time they really have after a SIGTERM (:func:`domino.train.preemption.
grace_period_s`). It imports nothing but the standard library and :mod:`domino.launch.processes`.

With ``DOMINO_WARM_RANKS=1`` a torchrun that runs ``-m domino`` is started as ``python -m domino.cli.torchrun``
with the same arguments: the same torchrun, with the ranks forked from an agent that imported torch, DeepSpeed
and domino once (:func:`warm_torchrun`).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from domino.launch.processes import alive, children, container_exit_code, signal_tree

#: The variable the relay exports to the ranks: the pod's grace period in seconds.
GRACE_PERIOD_ENV = "DOMINO_GRACE_PERIOD_S"
#: How often the relay looks at its processes (seconds).
POLL_S = 0.1


def is_torchrun(command: List[str]) -> bool:
    """Whether ``command`` starts torchrun (``torchrun ...``, ``python -m torch.distributed.run ...``, or its warm
    form ``python -m domino.cli.torchrun ...``)."""
    return bool(command) and (os.path.basename(command[0]) == "torchrun" or command[1:3] in (
        ["-m", "torch.distributed.run"], ["-m", "domino.cli.torchrun"]))


#: torchrun's options that take no value (torch 2.13 ``distributed/run.py``, ``get_args_parser``).
_TORCHRUN_FLAGS = {"-m", "--module", "--no-python", "--no_python", "--standalone", "--run-path", "--run_path",
                   "--virtual-local-rank", "--virtual_local_rank"}


def _torchrun_options(command: List[str]) -> Tuple[int, Dict[str, str], int]:
    """Where torchrun's own arguments start in ``command``, its options (``{name: value}``, ``""`` for a flag), and
    the index of the program it runs (``len(command)`` when none follows)."""
    start = 1 if os.path.basename(command[0]) == "torchrun" else 3
    options: Dict[str, str] = {}
    i = start
    while i < len(command) and command[i].startswith("-"):  # torchrun's options, up to the program
        name, equals, value = command[i].partition("=")
        if equals or name in _TORCHRUN_FLAGS:
            options[name], i = value, i + 1
        else:
            options[name], i = (command[i + 1] if i + 1 < len(command) else ""), i + 2
    return start, options, i


def torchrun_max_restarts(command: List[str]) -> int:
    """torchrun's ``--max-restarts`` (``--max_restarts``) in ``command``: 0 when absent or not torchrun."""
    if not is_torchrun(command):
        return 0
    _, options, _ = _torchrun_options(command)
    value = options.get("--max-restarts", options.get("--max_restarts", "0"))
    return int(value) if value.isdigit() else 0


def warm_torchrun(command: List[str], env: dict) -> List[str]:
    """``command``, or, with ``DOMINO_WARM_RANKS=1`` in ``env``, for torchrun running ``-m domino`` the same
    arguments to ``python -m domino.cli.torchrun``, which forks the ranks from an agent that imported torch,
    DeepSpeed and domino once. Opt-in: on this repository's CPU machine it saved 0-15 % of a preemption's cost with
    one rank per pod (benchmarks/RESULTS.md), and the fork has not run on a GPU node yet."""
    if not is_torchrun(command) or env.get("DOMINO_WARM_RANKS") != "1":
        return command
    start, options, program = _torchrun_options(command)
    module = "-m" in options or "--module" in options
    if not module or program >= len(command) or command[program] != "domino" or {
            "--no-python", "--no_python", "--run-path", "--run_path"} & options.keys():
        return command
    return [sys.executable, "-m", "domino.cli.torchrun", *command[start:]]


def command_environment(command: List[str], env: dict) -> dict:
    """``env`` for ``command``: a torchrun that restarts its workers (``--max-restarts N``, N > 0) gets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless set, without which its restarted workers cannot form their
    groups again (torch 2.13; :func:`domino.runtime.state.check_worker_restarts` has the sources)."""
    if torchrun_max_restarts(command) > 0:
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    return env


class Relay:
    """One command run under the relay: its process, and the signals relayed to it."""

    def __init__(self, command: List[str], env: Optional[dict] = None) -> None:
        self.command = command
        # A session of its own: a signal to the relay's process group (a terminal's Ctrl-C) does not reach torchrun.
        self.process = subprocess.Popen(command, env=env, start_new_session=True)
        self.received: Optional[int] = None  # the first signal relayed
        self.signalled: List[int] = []  # the ranks it went to
        self.torchrun_told = False

    def on_signal(self, signum: int, frame) -> None:
        """Relays ``signum``: to the ranks when torchrun has started them, else to the command."""
        if self.received is None:
            self.received = signum
        ranks = children(self.process.pid) if is_torchrun(self.command) else []
        if ranks:
            self.signalled = sorted(set(self.signalled) | set(ranks))
            signal_tree(ranks, signum)
        else:
            self.torchrun_told = True
            signal_tree([self.process.pid], signum)

    def poll(self) -> Optional[int]:
        """The command's exit status once it has exited; meanwhile reaps orphans (as PID 1, to whom the kernel
        re-parents them; elsewhere only its own child, leaving other processes' children alone) and tells
        torchrun when the ranks it signalled are gone."""
        while True:
            try:
                pid, status = os.waitpid(-1 if os.getpid() == 1 else self.process.pid, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == self.process.pid:
                self.process.returncode = os.waitstatus_to_exitcode(status)
                return self.process.returncode
        if self.signalled and not self.torchrun_told and not alive(self.signalled):
            self.torchrun_told = True
            signal_tree([self.process.pid], self.received)
        return None

    def exit_code(self, status: int) -> int:
        """The container's exit code for the command's ``status`` (a negative status: killed by that signal)."""
        code = container_exit_code(status)
        if code != 0 and self.received is not None:
            return 128 + self.received
        return code


def run(command: List[str], grace_period_s: Optional[int] = None) -> int:
    """Runs ``command`` under the relay until it exits; returns the container's exit code."""
    env = dict(os.environ)
    if grace_period_s is not None:
        env[GRACE_PERIOD_ENV] = str(grace_period_s)
    relay = Relay(warm_torchrun(command, env), command_environment(command, env))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, relay.on_signal)
    while True:
        status = relay.poll()
        if status is not None:
            return relay.exit_code(status)
        time.sleep(POLL_S)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m domino.launch.signal_relay", description=__doc__.split("\n")[0])
    parser.add_argument("--grace-period-s", type=int, default=None,
                        help="The pod's terminationGracePeriodSeconds, exported to the ranks as " + GRACE_PERIOD_ENV)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="The command to run (e.g. torchrun ...)")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command given")
    return run(args.command, args.grace_period_s)


if __name__ == "__main__":
    sys.exit(main())
