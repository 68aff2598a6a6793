"""The emulated TP link: its timing model (fake clock), its parsing, and real gloo collectives under it.

``tests/model/test_model_network_emulator.py`` checks that training under it is bit-identical.
"""

from __future__ import annotations

import logging

import pytest
import torch

from distributed_helpers import run_distributed
from domino.config import ConfigError
from domino.parallel import collectives as C
from domino.runtime import comm_timing, state
from domino.runtime.comm_timing import CommHandle
from domino.runtime.network_emulator import (ENV_VAR, LinkEmulator, LinkSpec, all_gather_wire_bytes,
                                              all_reduce_wire_bytes, link_from_environment, parse_spec)


class FakeClock:
    """A clock that only moves when told to (or when slept on); records every sleep."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _emulator(clock, latency_us=10.0, gbps=2.0):
    return LinkEmulator(LinkSpec(latency_us=latency_us, gbps=gbps), clock=clock, sleep=clock.sleep)


def test_spec_duration_is_latency_plus_bytes_over_bandwidth():
    spec = LinkSpec(latency_us=10.0, gbps=2.0)
    assert spec.seconds(4e9) == pytest.approx(10e-6 + 2.0)
    assert all_reduce_wire_bytes(1000, 2) == 1000  # 2 (n-1)/n
    assert all_reduce_wire_bytes(1000, 8) == 1750
    assert all_gather_wire_bytes(1000, 4) == 3000


def test_wait_before_completion_sleeps_exactly_the_remainder():
    clock = FakeClock()
    link = _emulator(clock)
    due = link.launch(2e6)  # 10 us + 1 ms
    assert due == pytest.approx(clock.now + 1.01e-3)
    clock.now += 0.4e-3  # the schedule computes something for 0.4 ms
    link.wait_until(due)
    assert clock.sleeps == [pytest.approx(0.61e-3)]
    assert clock.now == pytest.approx(due)


def test_wait_after_completion_does_not_sleep():
    clock = FakeClock()
    link = _emulator(clock)
    due = link.launch(2e6)
    clock.now += 5e-3
    link.wait_until(due)
    assert clock.sleeps == []


def test_link_carries_one_collective_at_a_time_and_counts_link_time():
    clock = FakeClock()
    link = _emulator(clock, latency_us=0.0, gbps=1.0)
    first = link.launch(1e6)  # 1 ms
    clock.now += 0.25e-3
    second = link.launch(2e6)  # queued behind the first: starts at its end
    assert second == pytest.approx(first + 2e-3)
    clock.now = second + 1.0  # idle link: the next one starts at launch
    assert link.launch(1e6) == pytest.approx(clock.now + 1e-3)
    assert link.pop_modelled_seconds() == pytest.approx(4e-3)
    assert link.pop_modelled_seconds() == 0.0


def test_handle_waits_for_the_data_then_the_link_and_counts_the_blocking():
    clock, order = FakeClock(), []

    class Work:
        def wait(self):
            order.append("data")
            clock.now += 0.2e-3  # the real transfer took 0.2 ms
            return True

        def is_completed(self):
            return True

    link = _emulator(clock, latency_us=0.0, gbps=1.0)
    timer = comm_timing.CommTimer()
    handle = CommHandle(Work(), None, link, link.launch(1e6), timer, "fwd mlp, chunk 1", None, None)
    assert not handle.is_completed()  # the data are there, the modelled link is not done yet
    assert handle.wait()
    assert order == ["data"] and clock.sleeps == [pytest.approx(0.8e-3)]
    assert handle.is_completed()
    assert list(timer.pop_by_site()) == ["fwd mlp, chunk 1"]


@pytest.mark.parametrize("text, field", [
    ("gbps=1", "latency_us"), ("latency_us=5", "gbps"), ("latency_us=5,gbps=abc", "gbps"),
    ("latency_us=-1,gbps=1", "latency_us"), ("latency_us=1,gbps=0", "gbps"), ("latency_us=1,gbps=nan", "gbps"),
    ("latency_us=1,gbps=1,jitter=2", "jitter"), ("latency_us", "latency_us"),
    ("latency_us=1,gbps=1,transfer=later", "transfer"),
])
def test_bad_spec_names_the_variable_and_the_field(text, field):
    with pytest.raises(ConfigError) as err:
        parse_spec(text)
    message = str(err.value)
    assert ENV_VAR in message and field in message and "\n" not in message


def test_environment_read_and_logged_loudly(caplog):
    assert link_from_environment({}) is None
    assert link_from_environment({ENV_VAR: " "}) is None
    with caplog.at_level(logging.WARNING):
        link = link_from_environment({ENV_VAR: "latency_us=5, gbps=12.5"})
    assert link.spec == LinkSpec(latency_us=5.0, gbps=12.5)
    assert parse_spec("latency_us=5,gbps=1,transfer=wait") == LinkSpec(latency_us=5.0, gbps=1.0, transfer="wait")
    assert any(ENV_VAR in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_bad_environment_fails_when_the_groups_are_created(monkeypatch):
    """The entry point reads the variable once, before any work: no process group or mesh exists after the error."""
    from domino.config import parse_config
    from domino.train import runtime_start

    monkeypatch.setenv(ENV_VAR, "latency_us=5,gbps=fast")
    with pytest.raises(ConfigError, match=f"{ENV_VAR}: field gbps"):
        runtime_start.initialize_runtime(parse_config(["--preset", "tiny"]))
    assert not torch.distributed.is_initialized() and not state.model_parallel_is_initialized()


def test_the_link_is_a_value_given_to_the_mesh(monkeypatch):
    """``initialize_model_parallel`` takes the link it is given and reads no environment."""
    monkeypatch.setenv(ENV_VAR, "latency_us=5,gbps=fast")  # ignored below the entry point
    link = LinkEmulator(LinkSpec(latency_us=1.0, gbps=2.0))
    try:
        assert state.initialize_model_parallel(1).tp.link is None
        assert state.initialize_model_parallel(1, link=link).tp.link is link
    finally:
        state.destroy_model_parallel()


def _fake_clock_body(rank, world_size, transfer):
    """Real gloo collectives under an emulated link with a fake clock: each sleeps the modelled remainder."""
    state.initialize_model_parallel(2)
    clock = FakeClock()
    state.set_tensor_model_parallel_link(LinkEmulator(LinkSpec(latency_us=0.0, gbps=1.0, transfer=transfer),
                                                      clock=clock, sleep=clock.sleep))
    tp = state.current_mesh().tp  # the TP group on that link
    x = torch.full((1000,), float(rank + 1))  # 4000 bytes: 4 us on the modelled link
    C.all_reduce_sum_(x, tp)  # synchronous: sleeps right away
    handle = C.all_reduce_async(x, tp)  # asynchronous: nothing slept at launch
    slept_at_launch = list(clock.sleeps)
    # transfer=wait: gloo has not been handed the data yet (x still holds the first sum); launch: x may be reduced.
    x_before_wait = x.clone()
    clock.now += 1e-6  # 1 us of "compute" before the schedule waits
    completed_before_wait = handle.is_completed()
    handle.wait()
    modelled = comm_timing.pop_modelled_comm_seconds(tp.link)
    sleeps = list(clock.sleeps)
    # Sequence parallelism's asynchronous reduce-scatter takes the same path.
    scatter, scattered = C.reduce_scatter_sequence_async(torch.full((2, 1, 3), float(rank + 1)), tp)  # [s, b, h]
    scatter.wait()
    comm_timing.pop_modelled_comm_seconds(tp.link)
    return {"sleeps": sleeps, "scattered": scattered, "slept_at_launch": slept_at_launch, "x": x,
            "modelled": modelled,
            "x_before_wait": x_before_wait, "completed_before_wait": completed_before_wait}


@pytest.mark.parametrize("transfer", ["launch", "wait"])
def test_collectives_sleep_the_modelled_remainder_on_real_gloo(transfer):
    for r in run_distributed(_fake_clock_body, 2, transfer):
        assert r["slept_at_launch"] == [pytest.approx(4e-6)]
        assert r["sleeps"] == [pytest.approx(4e-6), pytest.approx(3e-6)]
        assert torch.equal(r["x"], torch.full((1000,), 6.0))
        assert r["modelled"] == pytest.approx(8e-6)
        assert not r["completed_before_wait"]
        assert torch.equal(r["scattered"], torch.full((1, 1, 3), 3.0))
        if transfer == "wait":  # gloo moved nothing before wait(): the buffer still holds the first sum
            assert torch.equal(r["x_before_wait"], torch.full((1000,), 3.0))
