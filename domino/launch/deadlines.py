"""The cluster launcher's clocks: the overall timeout, the queue timeout and the scheduling timeout.

The scheduling timeout is meant to catch a job that cannot get its pods placed and started (no
capacity, an admission refusal, a bad image). Two waits are not that and can take many minutes on a
GPU cluster: pulling a multi-GB CUDA image, and a node pool scaling up for the job. While any pod of the
job is visibly in one of them the clock stops counting (up to :data:`MAX_PAUSE_S` in all), and when it
fires anyway the reason says how long it stood still and why. The pods' events say which wait it is:

* image pulls, from the kubelet (kubernetes ``pkg/kubelet/images/image_manager.go``
  ``EnsureImageExists``): ``Pulling`` ("Pulling image %q") before a pull, then ``Pulled``
  ("Successfully pulled image %q in ...", or "Container image %q already present on machine") or
  ``Failed`` ("Failed to pull image %q: ...");
* scale-ups, from the cluster autoscaler (kubernetes/autoscaler
  ``cluster-autoscaler/processors/status/eventing_scale_up_processor.go``): ``TriggeredScaleUp`` ("pod
  triggered scale-up: ...") on a pod a scale-up is for, ``NotTriggerScaleUp`` ("pod didn't trigger
  scale-up: ...") on one no node group can host.
"""

from __future__ import annotations

import time
from typing import Dict, Optional

#: The most the scheduling clock may stand still for image pulls and scale-ups, in all.
MAX_PAUSE_S = 3600.0
#: How long the clock stands still at a time before the pods' events are read again.
PAUSE_STEP_S = 30.0
#: What paused the clock, as the reason names it.
WAITS = {"pull": "image pulls", "scale-up": "waiting for a node scale-up"}


class Deadlines:
    """The overall timeout from the start; the queue timeout from each suspension (waiting for Kueue's
    admission); the scheduling timeout from the moment it is admitted, standing still during image pulls
    and scale-ups."""

    def __init__(self, start: float, timeout_s: Optional[float], scheduling_timeout_s: float,
                 queue_timeout_s: Optional[float], max_pause_s: float = MAX_PAUSE_S) -> None:
        self.timeout_s, self.queue_timeout_s = timeout_s, queue_timeout_s
        self.scheduling_timeout_s = scheduling_timeout_s
        self.end = start + timeout_s if timeout_s is not None else None
        self.queue_end: Optional[float] = None  # set while the job is suspended (see queue_timed_out)
        self.scheduling_end: Optional[float] = start + scheduling_timeout_s
        self.max_pause_s = max_pause_s
        self.paused: Dict[str, float] = {}

    def queue_timed_out(self, suspended: bool, now: float) -> bool:
        """Whether the job has waited for Kueue longer than the queue timeout. The clock starts each time the
        job is seen suspended, at creation (queued) or later (preempted: Kueue suspends an evicted job and
        re-admits it when quota frees up), so a job preempted after running for days gets the whole timeout
        to be re-admitted."""
        if not suspended:
            self.queue_end = None
            return False
        if self.queue_end is None and self.queue_timeout_s is not None:
            self.queue_end = now + self.queue_timeout_s
        return self.queue_end is not None and now >= self.queue_end

    def passed(self) -> bool:
        """Whether the overall timeout has passed."""
        return self.end is not None and time.monotonic() >= self.end

    def read_timeout(self, suspended: bool, all_running: bool, watch_s: float, poll_s: float) -> float:
        """How long one watch read may block: until the next deadline that applies, at most ``watch_s``."""
        now = time.monotonic()
        upcoming = [self.end, self.queue_end if suspended else None,
                    None if (suspended or all_running) else self.scheduling_end]
        return min([watch_s] + [max(poll_s, d - now) for d in upcoming if d is not None])

    def pause(self, wait: str) -> bool:
        """Stops the scheduling clock for one step because of ``wait`` (a key of :data:`WAITS`); False
        when the pauses have used up :data:`MAX_PAUSE_S`."""
        left = self.max_pause_s - sum(self.paused.values())
        if left <= 0 or self.scheduling_end is None:
            return False
        step = min(PAUSE_STEP_S, max(self.scheduling_timeout_s, 1.0), left)
        self.scheduling_end = max(self.scheduling_end, time.monotonic()) + step
        self.paused[wait] = self.paused.get(wait, 0.0) + step
        return True

    def not_counted(self) -> str:
        """`` (not counting 120 s of image pulls)`` for the reason, or ''."""
        parts = [f"{seconds:g} s of {WAITS[wait]}" for wait, seconds in self.paused.items()]
        return f" (not counting {', '.join(parts)})" if parts else ""
