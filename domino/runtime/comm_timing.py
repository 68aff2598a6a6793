"""How a tensor-parallel collective is launched and waited for: one handle that times it and rides the emulated link.

Every collective of :mod:`domino.parallel.collectives` starts here, in :func:`launch`, and ends in
:meth:`CommHandle.wait` (a synchronous collective is its launch followed at once by the wait). The handle

* waits for the ``torch.distributed`` work (or, on an emulated link with ``transfer=wait``, runs the collective
  synchronously inside ``wait()``, :mod:`domino.runtime.network_emulator`);
* sleeps whatever remains of the emulated link's time for it (none without ``DOMINO_SIMULATED_NETWORK``);
* adds the host time it blocked to its group's :class:`CommTimer`, under the site label of its launch;
* leaves the group's timer knowing the last collective entered and those launched but not yet waited for (what
  ``--hang-timeout-s`` reports, :mod:`domino.runtime.hang_watch`);
* keeps the collective's send buffer alive until then.

The counters are an object each mesh group carries, not module state: the training loop reads and resets its
TP group's timer once per log interval. With NCCL a wait only orders CUDA streams
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


class CommTimer:
    """Where the blocked time of one group's collectives is counted, by call site: the host seconds spent inside
    synchronous collectives and in ``wait()`` of asynchronous ones (on CUDA, the stream stalls, read from events
    once per pop). Each :class:`~domino.runtime.mesh.MeshGroup` carries one; the training loop reads and resets
    its TP group's once per log interval (the ``comm-wait`` timer)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._by_site: Dict[str, float] = {}
        self._label: Optional[str] = None
        # CUDA: ``(site, start event, end event)`` of the waits since the last pop, resolved into the counts then.
        self._device_waits: List[Tuple[str, object, object]] = []
        #: The site of the last collective launched, and the launched ones not yet waited for (by handle id): what
        #: the hang watch reports (read from its thread; plain attribute and dict operations, atomic under the GIL).
        self.entered: Optional[str] = None
        self.in_flight: Dict[int, str] = {}

    @contextlib.contextmanager
    def site(self, name: Optional[str]) -> Iterator[None]:
        """Labels the collectives launched inside (for :meth:`pop_by_site`); an asynchronous one keeps the label of
        its launch when it is waited on later. Host-side bookkeeping only: no effect on results."""
        previous, self._label = self._label, name
        try:
            yield
        finally:
            self._label = previous

    def current_site(self, kind: str) -> str:
        """The label of the enclosing :meth:`site`, else ``kind``."""
        return self._label or kind

    def count(self, seconds: float, site: str) -> None:
        """Adds ``seconds`` blocked at ``site``."""
        self._seconds += seconds
        self._by_site[site] = self._by_site.get(site, 0.0) + seconds

    def add_device_wait(self, site: str, start, end) -> None:
        """A CUDA stall between two recorded events, counted at the next pop."""
        self._device_waits.append((site, start, end))

    def _resolve_device_waits(self) -> None:
        for site, start, end in self._device_waits:
            end.synchronize()  # at the log interval: the events of the whole interval are read at once
            self.count(start.elapsed_time(end) / 1e3, site)
        self._device_waits.clear()

    def pop_seconds(self) -> float:
        """The blocked seconds since the last call; resets the count."""
        self._resolve_device_waits()
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def pop_by_site(self) -> Dict[str, float]:
        """The blocked seconds since the last call per call site (the labels of :meth:`site`); resets them.

        Sums to what :meth:`pop_seconds` returns over the same interval. Collectives launched outside any site are
        labelled by their kind (``"all-reduce fwd"``, ``"all-reduce bwd"``, ``"cross-entropy"``, ...).
        """
        self._resolve_device_waits()
        out, self._by_site = self._by_site, {}
        return out


def _device_event(source: Optional[torch.Tensor]):
    """A timing CUDA event recorded now on the current stream when ``source`` is on a GPU, else None."""
    if source is None or source.device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def pop_modelled_comm_seconds(link: Optional[LinkEmulator]) -> float:
    """Emulated time on ``link`` (the mesh's TP link) of the collectives launched since the last call (0 without
    an emulated link)."""
    return link.pop_modelled_seconds() if link is not None else 0.0


def comm_site(name: Optional[str], group) -> contextlib.AbstractContextManager:
    """``group.timer.site(name)``: labels the collectives over ``group`` (a ``MeshGroup``) launched inside."""
    return group.timer.site(name)


class CommHandle:
    """A launched collective: :meth:`wait` returns once its data arrived and its emulated link time passed."""

    __slots__ = ("work", "deferred", "link", "due", "timer", "site", "source", "started", "started_event")

    def __init__(self, work, deferred: Optional[Callable[[], None]], link: Optional[LinkEmulator],
                 due: Optional[float], timer: CommTimer, site: str, source: Optional[torch.Tensor],
                 started: Optional[float], started_event=None) -> None:
        self.work = work
        self.timer = timer  # the group's: the blocked time is counted there
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
            self.timer.count(time.perf_counter() - started, self.site)
            self.timer.in_flight.pop(id(self), None)
            self.source, self.started = None, None

    def _wait_on_device(self) -> bool:
        """:meth:`wait` for CUDA tensors: the stall it causes on the current stream, timed by two events."""
        start = self.started_event or _device_event(self.source)
        self.work.wait()  # orders the current stream after the collective: the stream stalls, the host does not
        self.timer.add_device_wait(self.site, start, _device_event(self.source))
        self.timer.in_flight.pop(id(self), None)
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
        group: the mesh group (:class:`~domino.runtime.mesh.MeshGroup`): the collective rides its emulated link,
            if it has one, and its blocked time is counted by the group's :class:`CommTimer`.
        kind: the comm-wait label when no :meth:`CommTimer.site` encloses the launch.
        blocking: the caller waits at once (a synchronous collective): its blocking counts from here.

    Returns:
        The handle; nothing the collective writes may be read before its ``wait()``.
    """
    started = time.perf_counter() if blocking else None
    started_event = _device_event(source) if blocking else None
    if group.process_group is None and group.size > 1:
        raise RuntimeError(f"a collective over a {group.size}-rank group without a process group (a shapes-only "
                           "MeshGroup sizes a model but cannot run it)")
    link, timer = group.link, group.timer
    due = link.launch(wire_bytes) if link is not None else None
    site = timer.current_site(kind)
    timer.entered = site
    if link is not None and link.spec.transfer == "wait":  # gloo moves the data in wait(), after the others' work
        handle = CommHandle(None, lambda: collective(False), link, due, timer, site, source, started)
    else:
        # Async launch: the caller computes meanwhile and reads the result only after the handle's wait().
        handle = CommHandle(collective(True), None, link, due, timer, site, source, started, started_event)
    timer.in_flight[id(handle)] = site
    return handle
