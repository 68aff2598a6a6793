"""How a tensor-parallel collective is launched and waited for: one handle that times it and rides the emulated link.

Every collective of :mod:`domino.parallel.collectives` starts here, in :func:`launch`, and ends in
:meth:`CommHandle.wait` (a synchronous collective is its launch followed at once by the wait). The handle

* waits for the ``torch.distributed`` work (or, on an emulated link with ``transfer=wait``, runs the collective
  synchronously inside ``wait()``, :mod:`domino.runtime.network_emulator`);
* sleeps whatever remains of the emulated link's time for it (none without ``DOMINO_SIMULATED_NETWORK``);
* adds the host time it blocked to the ``comm-wait`` count, under the :func:`comm_site` label of its launch;
* keeps the collective's send buffer alive until then.

The training loop reads and resets the totals once per log interval. With NCCL a wait only orders CUDA streams
(the host returns at once; the compute stream stalls until the collective is done), so for a collective on CUDA
tensors the handle times the wait on the device instead: a CUDA event recorded on the current stream before the
wait (at the launch, for a synchronous collective) and one after it; the time between them is what the stream
stalled. The events are read once per log interval, when the totals are (a wait for the device then, none in
the step); without CUDA the host's blocking is the figure.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from domino.runtime.network_emulator import LinkEmulator

# Host seconds this process spent blocked in tensor-parallel collectives: inside synchronous ones, and
# in ``wait()`` of Domino's asynchronous ones. The training loop reports it as the ``comm-wait`` timer.
_blocked_seconds = [0.0]
# The same seconds by call site (``comm_site``): where a schedule still exposes communication.
_blocked_by_site: Dict[str, float] = {}
_site: list = [None]
# CUDA: ``(site, start event, end event)`` of the waits since the last pop, resolved into the counts above then.
_device_waits: List[Tuple[str, object, object]] = []


def _device_event(source: Optional[torch.Tensor]):
    """A timing CUDA event recorded now on the current stream when ``source`` is on a GPU, else None."""
    if source is None or source.device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _resolve_device_waits() -> None:
    for site, start, end in _device_waits:
        end.synchronize()  # at the log interval: the events of the whole interval are read at once
        _count_blocked(start.elapsed_time(end) / 1e3, site)
    _device_waits.clear()


def pop_comm_wait_seconds() -> float:
    """Returns the blocked seconds accumulated since the last call, and resets the count."""
    _resolve_device_waits()
    seconds, _blocked_seconds[0] = _blocked_seconds[0], 0.0
    return seconds


def pop_comm_wait_by_site() -> Dict[str, float]:
    """The blocked seconds since the last call per call site (the labels of :func:`comm_site`), and resets them.

    Sums to what :func:`pop_comm_wait_seconds` returns over the same interval. Collectives launched outside any
    ``comm_site`` are labelled by their kind (``"all-reduce fwd"``, ``"all-reduce bwd"``, ``"cross-entropy"``, ...).
    """
    _resolve_device_waits()
    out = dict(_blocked_by_site)
    _blocked_by_site.clear()
    return out


def pop_modelled_comm_seconds(link: Optional[LinkEmulator]) -> float:
    """Emulated time on ``link`` (the mesh's TP link) of the collectives launched since the last call (0 without
    an emulated link)."""
    return link.pop_modelled_seconds() if link is not None else 0.0


@contextlib.contextmanager
def comm_site(name: Optional[str]) -> Iterator[None]:
    """Labels the collectives launched inside (for :func:`pop_comm_wait_by_site`); an asynchronous one keeps
    the label of its launch when it is waited on later. Host-side bookkeeping only: no effect on results."""
    previous, _site[0] = _site[0], name
    try:
        yield
    finally:
        _site[0] = previous


def current_site(kind: str) -> str:
    """The label of the enclosing :func:`comm_site`, else ``kind``."""
    return _site[0] or kind


def _count_blocked(seconds: float, site: str) -> None:
    _blocked_seconds[0] += seconds
    _blocked_by_site[site] = _blocked_by_site.get(site, 0.0) + seconds


class CommHandle:
    """A launched collective: :meth:`wait` returns once its data arrived and its emulated link time passed."""

    __slots__ = ("work", "deferred", "link", "due", "site", "source", "started", "started_event")

    def __init__(self, work, deferred: Optional[Callable[[], None]], link: Optional[LinkEmulator],
                 due: Optional[float], site: str, source: Optional[torch.Tensor], started: Optional[float],
                 started_event=None) -> None:
        self.work = work
        self.deferred = deferred  # transfer=wait: the synchronous collective still to run in wait()
        self.link, self.due = link, due
        self.site = site
        self.source = source  # the send buffer, kept alive until the collective has read it
        self.started = started  # set for a synchronous collective: its blocking counts from the launch
        self.started_event = started_event  # the same on the device (CUDA)

    def wait(self) -> bool:
        """Blocks until the collective finished (on the emulated link too); safe to call more than once."""
        if self.source is not None and self.source.device.type == "cuda" and self.link is None:
            return self._wait_on_device()
        started = self.started if self.started is not None else time.perf_counter()
        try:
            if self.deferred is not None:
                run, self.deferred = self.deferred, None
                run()
            elif self.work is not None:
                self.work.wait()
            if self.link is not None:
                self.link.wait_until(self.due)
            return True
        finally:
            _count_blocked(time.perf_counter() - started, self.site)
            self.source, self.started = None, None

    def _wait_on_device(self) -> bool:
        """:meth:`wait` for CUDA tensors: the stall it causes on the current stream, timed by two events."""
        start = self.started_event or _device_event(self.source)
        self.work.wait()  # orders the current stream after the collective: the stream stalls, the host does not
        _device_waits.append((self.site, start, _device_event(self.source)))
        self.source, self.started, self.started_event = None, None, None
        return True

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return at once."""
        data = self.deferred is None and (self.work is None or self.work.is_completed())
        return data and (self.link is None or self.link.clock() >= self.due)


class _Done:
    """Stands in for a handle when nothing was launched (one rank): ``wait()`` returns at once."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


#: The handle of a collective over one rank: nothing to wait for.
DONE = _Done()


def launch(collective: Callable[[bool], object], wire_bytes: float, source: torch.Tensor, group,
           kind: str = "async", blocking: bool = False) -> CommHandle:
    """Launches ``collective(async_op)`` over ``group``, on the group's emulated link when it has one.

    Args:
        collective: issues the ``torch.distributed`` call with the given ``async_op`` and returns its work.
        wire_bytes: what one rank sends (the emulated link's cost, :mod:`domino.runtime.network_emulator`).
        source: the send buffer; kept alive until the wait.
        group: the mesh group (:class:`~domino.runtime.mesh.MeshGroup`; None in tests without one): the
            collective rides its emulated link, if it has one.
        kind: the comm-wait label when no :func:`comm_site` encloses the launch.
        blocking: the caller waits at once (a synchronous collective): its blocking counts from here.

    Returns:
        The handle; nothing the collective writes may be read before its ``wait()``.
    """
    started = time.perf_counter() if blocking else None
    started_event = _device_event(source) if blocking else None
    if group is not None and group.process_group is None and group.size > 1:
        raise RuntimeError(f"a collective over a {group.size}-rank group without a process group (a shapes-only "
                           "MeshGroup sizes a model but cannot run it)")
    link = group.link if group is not None else None
    due = link.launch(wire_bytes) if link is not None else None
    site = current_site(kind)
    if link is not None and link.spec.transfer == "wait":  # gloo moves the data in wait(), after the others' work
        return CommHandle(None, lambda: collective(False), link, due, site, source, started)
    # Async launch: the caller computes meanwhile and reads the result only after the handle's wait().
    return CommHandle(collective(True), None, link, due, site, source, started, started_event)
