"""The children a rank starts never act on a stop signal: only the rank decides, and they end when it ends.

A rank that gets SIGTERM saves at the next step and exits (:mod:`domino.train.preemption`). Its helper processes
must not act on the same signal, and they are often sent it too:

* torchrun's shutdown signals each rank's whole process group: torch 2.13 starts every worker in a session of its
  own (``torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py``,
  ``start_new_session=True``) and closes it with ``os.killpg`` (``SubprocessHandler.close``), so the rank's forked
  children, which share its group, get the SIGTERM with it;
* Slurm's ``scancel``, a cgroup-wide kill and a terminal's Ctrl-C (SIGINT to the foreground group) reach every
  process of the job at once.

A torch DataLoader worker dies of SIGTERM from anyone but its parent (``handler_SIGTERM`` in
``torch/csrc/DataLoader.cpp`` exits quietly only when ``si_pid == getppid()``, else re-raises the default action),
and the rank's SIGCHLD handler then raises "DataLoader worker (pid N) is killed by signal: Terminated"
(``torch/utils/data/_utils/signal_handling.py`` ``_set_SIGCHLD_handler``) at whatever the rank was doing, before the
step boundary where it would have saved. So every child ignores SIGTERM and SIGINT from its first instruction on:

* :func:`stop_signals_held` blocks both in the thread that starts children, so a signal that arrives between the
  fork and the child's own set-up stays pending (the parent acts on it when the block ends; a child's pending set
  starts empty, POSIX fork(2));
* :func:`shield_child`, the child's first act, sets both to ``SIG_IGN`` and only then unblocks them.

A child still ends with its parent: :func:`shield_child` asks the kernel for SIGKILL when the thread that forked it
exits (``PR_SET_PDEATHSIG``, prctl(2); it names the forking *thread*, so it is requested only for children forked
by the main thread, which lives as long as the process), and torch's DataLoader workers also poll for a changed
parent pid every 5 s (``ManagerWatchdog`` in ``torch/utils/data/_utils/worker.py``, ``MP_STATUS_CHECK_INTERVAL``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

#: The signals with which a scheduler or a person asks a job to stop; a rank's children ignore both.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Blocks SIGTERM and SIGINT in this thread while it starts children (they inherit the blocked mask)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a signal that came meanwhile is delivered here


def shield_child(parent_pid: int, forked_by_main_thread: bool) -> None:
    """In a freshly started child: ignore SIGTERM and SIGINT, then unblock them; die with the parent.

    Args:
        parent_pid: the pid of the process that started this child.
        forked_by_main_thread: the parent's main thread started this child, so the kernel may kill it when that
            thread (the process) ends.
    """
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if forked_by_main_thread:
        _die_with_parent(parent_pid)


def _die_with_parent(parent_pid: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent ended before the request: nothing would signal this child
        os._exit(0)


class ShieldedWorkerInit:
    """A DataLoader ``worker_init_fn`` that shields each worker, then calls the user's own (if any).

    Made in the parent; a forked worker compares its thread id with the parent's main thread's (fork(2) keeps the
    forking thread's id in the child) to learn whether the main thread started it.
    """

    def __init__(self, then: Optional[Callable[[int], None]] = None) -> None:
        self.parent_pid = os.getpid()
        self.main_thread_ident = threading.main_thread().ident
        self.then = then

    def __call__(self, worker_id: int) -> None:
        shield_child(self.parent_pid, forked_by_main_thread=threading.get_ident() == self.main_thread_ident)
        if self.then is not None:
            self.then(worker_id)
