"""``--log-straggler``: each rank's compute time per step, compared across ranks every log interval.

Synchronous training runs at the pace of its slowest rank (thermal throttling, a noisy neighbour, a degraded link),
and from rank 0's throughput alone nobody can tell which rank it is. Megatron-LM's ``--log-straggler``
(``megatron/core/utils.py`` ``StragglerDetector``) times each rank's kernels and reports the min and max ranks at its
log interval; here a rank's *compute* time is its interval's wall time less the pauses (saves, evaluation) and
less the time it was blocked in tensor-parallel collectives (:mod:`domino.runtime.comm_timing`, the same
``comm-wait`` the timers print): a slow rank computes longer and waits less, its peers wait for it. Every log
interval each rank's figure is all-gathered on a gloo group of its own, on the host: the numbers are host timings
already taken, so nothing waits for the device. A rank more than :data:`STRAGGLER_RATIO` times the median is named
(rank and host) in the log line, the metrics record (``stragglers``, ``compute_s_by_rank``), TensorBoard and MLflow
(``straggler/slowest_ratio``) and Prometheus (``domino_straggler_slowest_ratio``), for as long as it lasts.

Only tensor-parallel collectives are timed, so a slow rank is told apart from ranks it shares a TP group with;
ranks that meet only in the data-parallel gradient all-reduce (timed inside DeepSpeed) wait there unseen, and all
look alike.
"""

from __future__ import annotations

import statistics
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

#: A rank whose compute time per step exceeds the median's by more than this factor is a straggler (Megatron's
#: detector reports min/max; the issue's and most fleets' rule of thumb is 10 %).
STRAGGLER_RATIO = 1.10


class StragglerDetector:
    """Gathers each rank's compute time per iteration at log intervals (collective: every rank calls it).

    Args:
        enabled: ``--log-straggler``.
        hosts: every rank's host name, by global rank.
        timeout_minutes: the side group's collective timeout.
    """

    def __init__(self, enabled: bool, hosts: Sequence[str], timeout_minutes: float) -> None:
        self.enabled = enabled and dist.is_initialized() and dist.get_world_size() > 1
        self.hosts = list(hosts)
        self._group = None
        if self.enabled:
            # A host-side group of its own (new_group is collective: every rank builds the trainer, in order).
            self._group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))

    def measure(self, elapsed_s: float, blocked_s: float, iterations: int) -> Dict[str, Any]:
        """This interval's fields for the metrics record (empty when off): every rank's compute seconds per
        iteration and the stragglers among them."""
        if not self.enabled:
            return {}
        mine = torch.tensor([max(0.0, elapsed_s - blocked_s) / max(iterations, 1)], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(every, mine, group=self._group)  # gloo, on the host: a few bytes a rank
        compute = [float(t) for t in every]
        return {"compute_s_by_rank": compute, **stragglers(compute, self.hosts)}


def stragglers(compute: List[float], hosts: Sequence[str]) -> Dict[str, Any]:
    """The ranks more than :data:`STRAGGLER_RATIO` times the median compute time, slowest first, and the slowest
    rank's ratio to the median."""
    median = statistics.median(compute)
    if median <= 0:
        return {"stragglers": [], "straggler_slowest_ratio": None}
    slow = sorted((r for r, c in enumerate(compute) if c > STRAGGLER_RATIO * median), key=lambda r: -compute[r])
    return {"stragglers": [{"rank": r, "host": hosts[r] if r < len(hosts) else "?", "ratio": compute[r] / median}
                           for r in slow],
            "straggler_slowest_ratio": max(compute) / median}


def format_stragglers(record: Dict[str, Any]) -> Optional[str]:
    """The log line's part naming the stragglers, if any."""
    found = record.get("stragglers")
    if not found:
        return None
    return "stragglers: " + ", ".join(f"rank {s['rank']} ({s['host']}) {s['ratio']:.2f}x the median compute"
                                      for s in found)
