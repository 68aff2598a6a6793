"""The pods of a job: following the rank-0 pod's log, explaining a stuck job, reading exit codes.

Which pods belong to the job, which of them is rank 0, the training container's name and where the
events are come from the job's :class:`~domino.launch.job_api_base.JobApi`. Everything here works on
plain dicts (the API's JSON), read with ``_preload_content=False``, so it does not depend on the
client's model classes accepting every field a cluster returns.
"""

from __future__ import annotations

import collections
import json
import re
import socket
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from domino.launch.job_api_base import JobApi


def _json(response) -> Dict[str, Any]:
    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


def list_job_pods(core, namespace: str, api: JobApi, job: str, timeout_s: float) -> List[Dict[str, Any]]:
    """The training pods of ``job`` (by the API's label selector)."""
    resp = core.list_namespaced_pod(namespace, label_selector=api.pod_selector(job),
                                    _preload_content=False, _request_timeout=timeout_s)
    return _json(resp).get("items", [])


def container_status(pod: Dict[str, Any], container: str) -> Dict[str, Any]:
    """The training container's status (empty when not reported yet)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return status
    return {}


def exit_code(pod: Optional[Dict[str, Any]], container: str) -> Optional[int]:
    """The training container's exit code (current or last termination), if it has ended."""
    if pod is None:
        return None
    status = container_status(pod, container)
    for key in ("state", "lastState"):
        terminated = (status.get(key) or {}).get("terminated")
        if terminated and terminated.get("exitCode") is not None:
            return int(terminated["exitCode"])
    return None


def failed_pod_logs(core, namespace: str, pods: List[Dict[str, Any]], container: str, tail_lines: int,
                    timeout_s: float) -> Dict[str, List[str]]:
    """The last log lines of every pod whose training container failed (now, or before a restart:
    then the previous container's log), by pod name."""
    out: Dict[str, List[str]] = {}
    for pod in pods:
        status = container_status(pod, container)
        now_failed = ((status.get("state") or {}).get("terminated") or {}).get("exitCode", 0) != 0
        before = ((status.get("lastState") or {}).get("terminated") or {}).get("exitCode", 0) != 0
        if not (now_failed or before or (pod.get("status") or {}).get("phase") == "Failed"):
            continue
        name = pod["metadata"]["name"]
        try:
            text = core.read_namespaced_pod_log(name, namespace, container=container, tail_lines=tail_lines,
                                                previous=not now_failed and before, _request_timeout=timeout_s)
        except Exception as error:  # the pod may be gone; say so instead of failing the report
            text = f"(log unavailable: {type(error).__name__})"
        out[name] = text.splitlines()[-tail_lines:]
    return out


#: Normal events that explain a pod that waits: the cluster autoscaler's (see domino.launch.deadlines).
EXPLAINING_NORMAL_EVENTS = ("NotTriggerScaleUp", "TriggeredScaleUp")
_PULL_IMAGE = re.compile(r'image "([^"]+)"')


def _pod_events(core, namespace: str, obj: str, timeout_s: float) -> List[Dict[str, Any]]:
    """The events of one object, oldest first (``lastTimestamp``, else ``eventTime``: events.k8s.io).

    client-go's recorder stamps events to the second, so a wait and its end may tie: the end sorts last
    (a wait that already ended must not stop the clock)."""
    resp = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={obj}",
                                      _preload_content=False, _request_timeout=timeout_s)
    events = _json(resp).get("items", [])
    return sorted(events, key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                                         e.get("reason") not in ("Pulling", "TriggeredScaleUp")))


def pod_waits(core, namespace: str, pods: List[Dict[str, Any]], timeout_s: float) -> List[Tuple[str, str]]:
    """What the job's not-yet-running pods are visibly waiting for, as (wait, text) with wait ``pull``
    (an image whose latest kubelet event is ``Pulling``) or ``scale-up`` (an unscheduled pod whose latest
    autoscaler event is ``TriggeredScaleUp``); see domino.launch.deadlines for the sources."""
    out: List[Tuple[str, str]] = []
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") in ("Running", "Succeeded", "Failed"):
            continue
        name = pod["metadata"]["name"]
        events = _pod_events(core, namespace, name, timeout_s)
        pulls: Dict[str, str] = {}  # image -> its latest pull event's reason
        for event in events:
            match = _PULL_IMAGE.search(event.get("message") or "")
            if event.get("reason") in ("Pulling", "Pulled", "Failed", "BackOff") and match:
                pulls[match.group(1)] = event["reason"]
        out += [("pull", f"pod {name} is pulling image {image}") for image, reason in pulls.items()
                if reason == "Pulling"]
        unscheduled = any(c.get("type") == "PodScheduled" and c.get("status") == "False"
                          for c in status.get("conditions") or [])
        scale = [e for e in events if e.get("reason") in EXPLAINING_NORMAL_EVENTS]
        if unscheduled and scale and scale[-1]["reason"] == "TriggeredScaleUp":
            out.append(("scale-up", f"pod {name} waits for a new node: {scale[-1].get('message', '')}"))
    return out


def explain_pending(core, namespace: str, api: JobApi, job: str, timeout_s: float) -> List[str]:
    """Why the job's pods don't run: unschedulable conditions, waiting containers, Warning events (and the
    autoscaler's scale-up events) on the job's objects (:meth:`JobApi.event_objects`) and pods."""
    lines: List[str] = []
    pods = list_job_pods(core, namespace, api, job, timeout_s)
    if not pods:
        lines.append(f"no pods were created (is the {api.kind} controller running, and did it accept the job?)")
    for pod in pods:
        pod_name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                lines.append(f"pod {pod_name} not scheduled: {cond.get('reason')}: {cond.get('message', '')}")
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
                lines.append(f"pod {pod_name} container {cs.get('name')} waiting: {waiting.get('reason')}: "
                             f"{waiting.get('message', '')}")
    seen = set()
    for obj in api.event_objects(job) + [p["metadata"]["name"] for p in pods]:
        for event in _pod_events(core, namespace, obj, timeout_s):
            if event.get("type") != "Warning" and event.get("reason") not in EXPLAINING_NORMAL_EVENTS:
                continue
            key = (obj, event.get("reason"), event.get("message"))
            if key not in seen:
                seen.add(key)
                lines.append(f"event on {obj}: {event.get('reason')}: {event.get('message', '')}")
    return lines


def _ts_key(stamp: str) -> Tuple[str, str]:
    """Orders RFC3339Nano stamps (Go trims trailing zeros of the fraction, so pad it)."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return head, frac.ljust(9, "0")


class MasterLogStreamer(threading.Thread):
    """Follows the rank-0 pod's training container log into ``log``, across container restarts.

    Lines carry server timestamps (``timestamps=true``); after a disconnect or a restart the stream is
    reopened and lines already shown are skipped by timestamp, so nothing is printed twice.
    """

    def __init__(self, core, namespace: str, api: JobApi, job: str, log: Callable[[str], None],
                 tail_lines: int = 50, poll_s: float = 2.0, request_timeout_s: float = 30.0) -> None:
        super().__init__(name=f"logs-{job}", daemon=True)
        self.core, self.namespace, self.api, self.job, self.log = core, namespace, api, job, log
        self.poll_s, self.request_timeout_s = poll_s, request_timeout_s
        self.tail: Deque[str] = collections.deque(maxlen=tail_lines)
        self.pod: Optional[Dict[str, Any]] = None
        self._stop_event = threading.Event()
        self._finishing = threading.Event()
        self._last_key: Optional[Tuple[str, str]] = None
        self._response = None

    def run(self) -> None:
        followed: Optional[Tuple[str, int]] = None  # container (pod uid, restart count) last followed
        done: Optional[Tuple[str, int]] = None  # container whose log was followed to its termination
        while not self._stop_event.is_set():
            try:
                pods = list_job_pods(self.core, self.namespace, self.api, self.job, self.request_timeout_s)
                pod = self.api.rank0_pod(pods, self.job)
            except Exception:  # API hiccup: the launcher's main loop reports real failures
                pod = None
            status = container_status(pod, self.api.container) if pod is not None else {}
            state = status.get("state") or {}
            if pod is not None and ("running" in state or "terminated" in state):
                self.pod = pod
                key = (pod["metadata"].get("uid", ""), int(status.get("restartCount", 0)))
                if key != done:
                    if followed is not None and key[0] == followed[0] and key[1] > followed[1]:
                        self.log(f"--- {pod['metadata']['name']}: container restarted (restart {key[1]}) ---")
                    followed = key
                    if self._follow(pod["metadata"]["name"]) and "terminated" in state:
                        done = key
                        continue
            if self._finishing.is_set():
                return
            self._stop_event.wait(self.poll_s)

    def _follow(self, pod_name: str) -> bool:
        """Streams one container's log to its end; False when the connection broke."""
        buffer = b""
        try:
            self._response = self.core.read_namespaced_pod_log(
                pod_name, self.namespace, container=self.api.container, follow=True, timestamps=True,
                _preload_content=False, _request_timeout=(self.request_timeout_s, None))
            for chunk in self._response.stream(4096):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    self._emit(raw.decode("utf-8", "replace"))
            if buffer:
                self._emit(buffer.decode("utf-8", "replace"))
            return True
        except Exception:  # disconnect or container not ready: retried by run()
            return False
        finally:
            if self._response is not None:
                self._response.release_conn()
                self._response = None

    def _emit(self, line: str) -> None:
        stamp, _, text = line.partition(" ")
        if not stamp[:4].isdigit():  # no timestamp (older servers): show as is
            stamp, text = "", line
        if stamp:
            key = _ts_key(stamp)
            if self._last_key is not None and key <= self._last_key:
                return
            self._last_key = key
        self.tail.append(text)
        self.log(text)

    def finish(self, grace_s: float) -> None:
        """Lets the current stream drain (up to ``grace_s``), then stops the thread."""
        self._finishing.set()
        self.join(grace_s)
        self.stop()

    def stop(self) -> None:
        """Stops following now: shuts the open stream's socket down (closing the response from this
        thread would block on the reader's lock), then waits briefly for the thread."""
        self._stop_event.set()
        _shutdown_socket(self._response)
        self.join(2.0)


def _shutdown_socket(response) -> None:
    """Makes a blocking read on ``response`` (urllib3) return, from another thread."""
    if response is None:
        return
    sock = getattr(getattr(response, "_connection", None), "sock", None)
    if sock is None:
        raw = getattr(getattr(getattr(response, "_fp", None), "fp", None), "raw", None)
        sock = getattr(raw, "_sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
