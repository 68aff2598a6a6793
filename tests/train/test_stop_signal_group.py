"""domino.train.preemption.StopSignal on its own: the flag launched at one step boundary and waited at the next
survives any time in between (an evaluation or a save longer than the group's timeout: gloo counts the timeout
from the launch until every peer has joined, not until the wait), every rank agrees, and world size 1 and a
disabled handler need no group."""

import os
import signal
import time

from distributed_helpers import run_distributed


def _boundaries(rank, world_size):
    from domino.train.preemption import StopSignal

    stop = StopSignal(True, timeout_minutes=2 / 60)  # a 2 s group timeout
    seen = []
    for boundary in range(3):
        if rank == 1:
            time.sleep(0.5)  # ranks reach the boundary at different times (within the timeout)
        seen.append(stop.requested())
        if boundary == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # caught: only recorded
        time.sleep(3)  # "a long evaluation": past the group's timeout, with the flag in flight
    stop.close()
    return seen


def test_a_flag_in_flight_outlives_the_group_timeout_and_every_rank_agrees():
    # Boundary 0 launches 0 on both ranks; rank 1's SIGTERM goes out at boundary 1; both read it at boundary 2.
    assert run_distributed(_boundaries, 2) == [[False, False, True], [False, False, True]]


def test_world_size_one_stops_at_the_next_boundary_and_restores_the_handler():
    from domino.train.preemption import StopSignal

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal(True, timeout_minutes=1)
    assert stop._group is None and not stop.requested()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested() and stop.since_signal_s() >= 0
    stop.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_disabled_installs_nothing():
    from domino.train.preemption import StopSignal

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal(False, timeout_minutes=1)
    assert signal.getsignal(signal.SIGTERM) is before and not stop.requested()
    stop.close()
