"""A rank's DataLoader workers ignore stop signals and die with the rank (:mod:`domino.child_signals`).

Real processes and signals: a parent that iterates the pretraining loader (``build_pretraining_data_loader``) with two
workers; the workers get SIGTERM and SIGINT from the test (not from their parent, which torch's own worker
handler would have excused), then the parent is SIGKILLed. The end-to-end cases under torchrun are in
``tests/train/test_stop_signal_children.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from domino.child_signals import stop_signals_held
from domino.launch.processes import alive, children

PARENT = textwrap.dedent("""
    import time, torch
    from domino.data.loader import build_pretraining_data_loader
    batches = iter(build_pretraining_data_loader(torch.arange(64), 0, 4, 0, 1, num_workers=2))
    next(batches)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
""")


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_loader_workers_ignore_stop_signals_and_end_with_their_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert parent.stdout.readline().strip() == "ready", parent.stderr.read()
        workers = children(parent.pid)
        assert len(workers) == 2
        for worker in workers:
            os.kill(worker, signal.SIGTERM)
            os.kill(worker, signal.SIGINT)
        time.sleep(0.5)
        assert alive(workers) == workers and parent.poll() is None, parent.stderr.read()  # nobody acted on them
        parent.kill()  # SIGKILL: the parent cannot shut its workers down itself
        parent.wait()
        # The kernel's parent-death signal; torch's own watchdog would notice only after up to 5 s.
        _wait_for(lambda: not alive(workers), 2, f"workers {alive(workers)} outlived their parent")
    finally:
        parent.kill()
        parent.wait()


def test_a_stop_signal_while_children_start_waits_for_the_parent_and_is_not_lost():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with stop_signals_held():
            # To this thread: a process-directed signal may go to any other thread of pytest's that does not block it.
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            time.sleep(0.1)
            assert received == []  # held while a fork would copy this thread's signal state
        _wait_for(lambda: received == [signal.SIGTERM], 2, "the held SIGTERM never arrived")
    finally:
        signal.signal(signal.SIGTERM, previous)
