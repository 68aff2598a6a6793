"""Host time blocked in tensor-parallel collectives: the ``comm-wait`` timer and its breakdown by call site.

:mod:`domino.parallel.collectives` counts here the time each synchronous collective blocks and each
asynchronous one blocks in ``wait()``; the training loop reads and resets the totals once per log interval.
With NCCL a wait only orders CUDA streams, so on GPUs this counts host blocking, not link time.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, Optional

from domino.runtime import state

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


@contextlib.contextmanager
def comm_site(name: Optional[str]) -> Iterator[None]:
    """Labels the collectives launched inside (for :func:`pop_comm_wait_by_site`); an asynchronous one keeps
    the label of its launch when it is waited on later. Host-side bookkeeping only: no effect on results."""
    previous, _site[0] = _site[0], name
    try:
        yield
    finally:
        _site[0] = previous


def count_blocked(seconds: float, site: str) -> None:
    """Adds ``seconds`` of blocking to the total and to ``site``'s share."""
    _blocked_seconds[0] += seconds
    _blocked_by_site[site] = _blocked_by_site.get(site, 0.0) + seconds


def current_site(kind: str) -> str:
    """The label of the enclosing :func:`comm_site`, else ``kind``."""
    return _site[0] or kind


def pop_modelled_comm_seconds() -> float:
    """Emulated link time of the TP collectives launched since the last call (0 without an emulated link)."""
    link = state.get_tensor_model_parallel_link()
    return link.pop_modelled_seconds() if link is not None else 0.0


class TimedWork:
    """A ``dist.Work`` whose ``wait()`` adds its blocking time to the comm-wait count (under its launch's site)."""

    __slots__ = ("work", "site")

    def __init__(self, work, kind: str = "async") -> None:
        self.work = work
        self.site = current_site(kind)

    def wait(self) -> bool:
        started = time.perf_counter()
        try:
            return self.work.wait()
        finally:
            count_blocked(time.perf_counter() - started, self.site)

    def is_completed(self) -> bool:
        return self.work.is_completed()
