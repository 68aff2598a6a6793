"""The comm-wait count: host blocking without CUDA; on CUDA the stall of the current stream between two timing
events around the wait, read at the log interval (rehearsed here with stand-ins for CUDA's events and tensors:
a NCCL wait returns to the host at once, so only the events see how long the stream waited)."""

import types

import torch

from domino.runtime import comm_timing
from domino.runtime.mesh import MeshGroup


class _Clock:
    now_ms = 0.0


class _FakeEvent:
    """``torch.cuda.Event(enable_timing=True)`` on a fake device clock."""

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = _Clock.now_ms

    def synchronize(self):
        assert self.at is not None

    def elapsed_time(self, end):
        return end.at - self.at


class _Work:
    def __init__(self, stall_ms):
        self.stall_ms = stall_ms

    def wait(self):  # NCCL's: the stream waits for the collective; here the fake device clock moves on
        _Clock.now_ms += self.stall_ms
        return True


def test_cuda_waits_count_the_streams_stall_and_host_waits_the_hosts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    group = MeshGroup()  # a group of one: launch() itself never looks at its size
    timer, other = group.timer, MeshGroup().timer
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    with comm_timing.comm_site("fwd attention, first layer, chunk 0", group):
        handle = comm_timing.launch(lambda async_op: _Work(5.0), 0.0, on_gpu, group)
    assert handle.wait()
    with comm_timing.comm_site("fwd mlp, first layer, chunk 0", group):
        # A synchronous collective counts from its launch: 2 ms of queued work, then a 3 ms stall.
        handle = comm_timing.launch(lambda async_op: _Work(3.0), 0.0, on_gpu, group, blocking=True)
        _Clock.now_ms += 2.0
        handle.wait()
    assert timer._device_waits  # nothing read on the host until the log interval
    by_site = timer.pop_by_site()
    assert by_site == {"fwd attention, first layer, chunk 0": 0.005, "fwd mlp, first layer, chunk 0": 0.005}
    assert timer.pop_seconds() == 0.010 and not timer._device_waits
    assert other.pop_seconds() == 0.0 and other.pop_by_site() == {}  # each group counts its own collectives

    on_cpu = torch.zeros(2)  # gloo: the host's own blocking, no events
    handle = comm_timing.launch(lambda async_op: _Work(7.0), 0.0, on_cpu, group)
    handle.wait()
    assert not timer._device_waits and 0.0 <= timer.pop_seconds() < 0.5
