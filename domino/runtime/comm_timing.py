"""How a tensor-parallel collective is launched and waited for: one handle that times it and rides the emulated link.

Every collective of :mod:`domino.parallel.collectives` starts here, in :func:`launch`, and ends in
:meth:`CommHandle.wait` (a synchronous collective is its launch followed at once by the wait). The handle

* waits for the ``torch.distributed`` work (or, on an emulated link with ``transfer=wait``, runs the collective
  synchronously inside ``wait()``, :mod:`domino.runtime.network_emulator`);
* sleeps whatever remains of the emulated link's time for it (none without ``DOMINO_SIMULATED_NETWORK``);
* adds the host time it blocked to the ``comm-wait`` count, under the :func:`comm_site` label of its launch;
* keeps the collective's send buffer alive until then.

The training loop reads and resets the totals once per log interval. With NCCL a wait only orders CUDA streams,
so on GPUs this counts host blocking, not link time.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, Optional

import torch

from domino.runtime import state
from domino.runtime.network_emulator import LinkEmulator

# Host seconds this process spent blocked in tensor-parallel collectives: inside synchronous ones, and
# in ``wait()`` of Domino's asynchronous ones. The training loop reports it as the ``comm-wait`` timer.
_blocked_seconds = [0.0]
# The same seconds by call site (``comm_site``): where a schedule still exposes communication.
_blocked_by_site: Dict[str, float] = {}
_site: list = [None]


def pop_comm_wait_seconds() -> float:
    """Returns the blocked seconds accumulated since the last call, and resets the count."""
    seconds, _blocked_seconds[0] = _blocked_seconds[0], 0.0
    return seconds


def pop_comm_wait_by_site() -> Dict[str, float]:
    """The blocked seconds since the last call per call site (the labels of :func:`comm_site`), and resets them.

    Sums to what :func:`pop_comm_wait_seconds` returns over the same interval. Collectives launched outside any
    ``comm_site`` are labelled by their kind (``"all-reduce fwd"``, ``"all-reduce bwd"``, ``"cross-entropy"``, ...).
    """
    out = dict(_blocked_by_site)
    _blocked_by_site.clear()
    return out


def pop_modelled_comm_seconds() -> float:
    """Emulated link time of the TP collectives launched since the last call (0 without an emulated link)."""
    link = state.get_tensor_model_parallel_link()
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

    __slots__ = ("work", "deferred", "link", "due", "site", "source", "started")

    def __init__(self, work, deferred: Optional[Callable[[], None]], link: Optional[LinkEmulator],
                 due: Optional[float], site: str, source: Optional[torch.Tensor], started: Optional[float]) -> None:
        self.work = work
        self.deferred = deferred  # transfer=wait: the synchronous collective still to run in wait()
        self.link, self.due = link, due
        self.site = site
        self.source = source  # the send buffer, kept alive until the collective has read it
        self.started = started  # set for a synchronous collective: its blocking counts from the launch

    def wait(self) -> bool:
        """Blocks until the collective finished (on the emulated link too); safe to call more than once."""
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
        group: the process group (its emulated link is :func:`domino.runtime.state.link_for`).
        kind: the comm-wait label when no :func:`comm_site` encloses the launch.
        blocking: the caller waits at once (a synchronous collective): its blocking counts from here.

    Returns:
        The handle; nothing the collective writes may be read before its ``wait()``.
    """
    started = time.perf_counter() if blocking else None
    link = state.link_for(group)
    due = link.launch(wire_bytes) if link is not None else None
    site = current_site(kind)
    if link is not None and link.spec.transfer == "wait":  # gloo moves the data in wait(), after the others' work
        return CommHandle(None, lambda: collective(False), link, due, site, source, started)
    # Async launch: the caller computes meanwhile and reads the result only after the handle's wait().
    return CommHandle(collective(True), None, link, due, site, source, started)
