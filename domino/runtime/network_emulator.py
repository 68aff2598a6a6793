"""An emulated interconnect for the tensor-parallel collectives (``DOMINO_SIMULATED_NETWORK``).

On a CPU machine gloo moves bytes through the same cores that compute, so the time a collective takes says
nothing about a GPU cluster's links, and nothing about how much of it a schedule such as Domino hides. With

    DOMINO_SIMULATED_NETWORK="latency_us=L,gbps=B"

every tensor-parallel collective of :mod:`domino.parallel.collectives` also costs the time a modelled link
would take (its handle, :class:`domino.runtime.comm_timing.CommHandle`, sleeps the rest in ``wait()``): it completes no earlier than ``start + L + wire_bytes / B`` (``B`` in GB/s, 10^9 bytes/s), where

* ``wire_bytes`` is what one rank sends: ``2 (n-1)/n x bytes`` for a ring all-reduce of ``bytes`` over ``n``
  ranks, ``(n-1) x bytes`` for an all-gather of ``bytes`` per rank;
* ``start`` is the launch time, or the modelled end of the previous collective if that is later: the link
  carries one collective at a time, in launch order, as NCCL's single communication stream does.

The remaining time is *slept* in ``wait()`` (never spun, so the other process keeps the core): a synchronous
collective waits right away, an asynchronous one where the schedule waits for it.

``transfer=launch`` (default) hands an asynchronous collective to gloo at launch, as on a GPU cluster. On these
CPU machines gloo's transfer thread then competes with the computation it should hide behind for the same
cores (a cost a GPU's copy engines and NCCL's few SMs mostly do not have), while a synchronous collective's
transfer runs while its process waits anyway. ``transfer=wait`` removes that artefact: gloo moves the data
when the schedule waits (all ranks wait in the same order, so the collectives still match), then the
remainder of the modelled time is slept. Its own bias is the opposite one: a fully hidden collective still
costs its real transfer at the wait, counted as blocked time. The data are gloo's, so
results are bit-identical with and without the emulator. Read once, by the entry point before any work
(:func:`link_from_environment`, called by :func:`domino.train.runtime_start.initialize_runtime`), and given to the
mesh as a value (``state.start(..., link=...)``); unset, the collectives take their plain path (one ``None`` check).

Data-parallel (ZeRO) collectives are issued by DeepSpeed, not by this layer, and are not emulated.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from domino.config import ConfigError

logger = logging.getLogger(__name__)

ENV_VAR = "DOMINO_SIMULATED_NETWORK"


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link."""

    latency_us: float
    """Fixed cost of every collective, in microseconds (>= 0)."""
    gbps: float
    """Bandwidth in GB/s (10^9 bytes per second, > 0) for the bytes one rank sends."""
    transfer: str = "launch"
    """When gloo moves an asynchronous collective's data: ``launch`` (at once) or ``wait`` (in ``wait()``)."""

    def seconds(self, wire_bytes: float) -> float:
        """Modelled duration of a collective that sends ``wire_bytes`` from each rank."""
        return self.latency_us * 1e-6 + wire_bytes / (self.gbps * 1e9)


def parse_spec(text: str) -> LinkSpec:
    """``"latency_us=L,gbps=B"`` -> :class:`LinkSpec`.

    Raises:
        ConfigError: naming ``DOMINO_SIMULATED_NETWORK`` and the field that is missing, unknown or invalid.
    """
    fields = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in ("latency_us", "gbps", "transfer"):
            raise ConfigError(f"{ENV_VAR}: unknown field {part!r} (expected latency_us=<microseconds>,gbps=<GB/s>"
                              f"[,transfer=launch|wait])")
        if name == "transfer":
            if value.strip() not in ("launch", "wait"):
                raise ConfigError(f"{ENV_VAR}: field transfer must be launch or wait, got {value.strip()!r}")
            fields[name] = value.strip()
            continue
        try:
            fields[name] = float(value)
        except ValueError:
            raise ConfigError(f"{ENV_VAR}: field {name} must be a number, got {value.strip()!r}") from None
    for name in ("latency_us", "gbps"):
        if name not in fields:
            raise ConfigError(f"{ENV_VAR}: field {name} is missing (expected latency_us=<microseconds>,gbps=<GB/s>)")
    if not fields["latency_us"] >= 0 or fields["latency_us"] == float("inf"):
        raise ConfigError(f"{ENV_VAR}: field latency_us must be a finite number >= 0, got {fields['latency_us']}")
    if not fields["gbps"] > 0 or fields["gbps"] == float("inf"):
        raise ConfigError(f"{ENV_VAR}: field gbps must be a finite number > 0, got {fields['gbps']}")
    return LinkSpec(**fields)


def all_reduce_wire_bytes(nbytes: int, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (n-1)/n x nbytes``."""
    return 2 * (world - 1) / world * nbytes


def all_gather_wire_bytes(nbytes_per_rank: int, world: int) -> float:
    """Bytes each rank sends in a ring all-gather of ``nbytes_per_rank`` from every rank: ``(n-1) x`` that."""
    return (world - 1) * nbytes_per_rank


class LinkEmulator:
    """The modelled link: hands out completion times and sleeps until them.

    Args:
        spec: latency and bandwidth.
        clock: monotonic seconds (injected by tests).
        sleep: sleeps a number of seconds (injected by tests).
    """

    def __init__(self, spec: LinkSpec, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.spec = spec
        self.clock = clock
        self.sleep = sleep
        self._link_free_at = float("-inf")
        self._modelled_seconds = 0.0

    def launch(self, wire_bytes: float) -> float:
        """Registers a collective launched now; returns the time at which it completes on the link."""
        start = max(self.clock(), self._link_free_at)
        duration = self.spec.seconds(wire_bytes)
        self._link_free_at = start + duration
        self._modelled_seconds += duration
        return self._link_free_at

    def wait_until(self, due: float) -> None:
        """Sleeps whatever remains until ``due`` (nothing when it has passed)."""
        remaining = due - self.clock()
        if remaining > 0:
            self.sleep(remaining)

    def pop_modelled_seconds(self) -> float:
        """Link time of the collectives launched since the last call (the sum of their durations)."""
        seconds, self._modelled_seconds = self._modelled_seconds, 0.0
        return seconds


def link_from_environment(environ: Optional[dict] = None) -> Optional[LinkEmulator]:
    """Reads ``DOMINO_SIMULATED_NETWORK`` and returns its emulator (None when unset or empty); logs it loudly.

    Raises:
        ConfigError: the value is malformed (naming the variable and the field: :func:`parse_spec`).
    """
    text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not text:
        return None
    spec = parse_spec(text)
    logger.warning("%s is set: every tensor-parallel collective is slowed to an emulated link of %g us latency "
                   "and %g GB/s, gloo transfers at %s (timings are NOT those of this machine's network)", ENV_VAR,
                   spec.latency_us, spec.gbps, spec.transfer)
    return LinkEmulator(spec)
