"""Why a queued job waits: its Kueue Workload's own words, read while the job is suspended.

Kueue's job reconciler creates one Workload per job in the job's namespace, owned by the job (a controller
owner reference) and labelled ``kueue.x-k8s.io/job-uid: <the job's uid>`` (kubernetes-sigs/kueue v0.19.2
``pkg/controller/jobframework/reconciler.go`` ``constructWorkload``, ``pkg/controller/constants``
``JobUIDLabel``). Its name is ``<kind>-<job name>-<hash>`` (``jobframework/workload_names.go``
``GetWorkloadNameForOwnerWithGVK``), but the hash inputs and the length limit differ across releases (with or
without the owner's UID or a generation, the ``ShortWorkloadNames`` feature), so the Workload is found by
listing that label and keeping the one whose owner reference carries the job's uid, never by rebuilding the name.

What is reported (``apis/kueue/v1beta2`` ``workload_types.go``): the ``QuotaReserved`` and ``Admitted``
conditions with their reason and message, e.g. ``QuotaReserved False (Pending): couldn't assign flavors to
pod set node: insufficient unused quota for nvidia.com/gpu in flavor default-flavor, 8 more needed``, plus
``Evicted`` while true; and, where Kueue serves its visibility API (the ``VisibilityOnDemand`` feature), the
Workload's ``positionInLocalQueue`` (0 = next) in the ``PendingWorkloadsSummary`` of
``visibility.kueue.x-k8s.io/<version>/namespaces/<ns>/localqueues/<queue>/pendingworkloads`` (``pkg/visibility``).
Reads the launcher Role
(``k8s/base/launcher-rbac.yaml``) grants; a refused or missing read is reported once and never fails the run.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, Optional

from domino.launch.check import KUEUE_GROUP, KUEUE_VERSIONS

WORKLOADS = "workloads"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
VISIBILITY_GROUP = "visibility.kueue.x-k8s.io"
#: The conditions that say why a Workload waits, in the order they happen.
REPORTED = ("QuotaReserved", "Admitted", "Evicted")


def workload_reason(workload: Dict[str, Any]) -> str:
    """``QuotaReserved False (Pending): ...; Admitted False (NoReservation): ...`` from its conditions."""
    conditions = {c.get("type"): c for c in (workload.get("status") or {}).get("conditions") or []}
    parts = []
    for ctype in REPORTED:
        cond = conditions.get(ctype)
        if cond is None or (ctype == "Evicted" and cond.get("status") != "True"):
            continue
        text = f"{ctype} {cond.get('status')}" + (f" ({cond['reason']})" if cond.get("reason") else "")
        parts.append(text + (f": {cond['message']}" if cond.get("message") else ""))
    return "; ".join(parts) or "no conditions yet (Kueue has not considered it)"


class QueueReporter:
    """Reads a suspended job's Workload and logs Kueue's reason each time it changes.

    Args:
        custom: a ``kubernetes.client.CustomObjectsApi``.
        namespace, queue: where the job waits (its ``kueue.x-k8s.io/queue-name``).
        log: receives one line per change.
        request_timeout_s: timeout of each read.
        interval_s: the least time between two reads.
    """

    def __init__(self, custom, namespace: str, queue: str, log: Callable[[str], None], request_timeout_s: float = 30.0,
                 interval_s: float = 10.0) -> None:
        self.custom, self.namespace, self.queue, self.log = custom, namespace, queue, log
        self.timeout, self.interval_s = request_timeout_s, interval_s
        self.last = ""  # the latest reason, for the final error
        self._read_at: Optional[float] = None
        self._version: Optional[str] = None
        self._unreadable: set = set()

    def _call(self, what: str, call, *args, **kwargs) -> Optional[Dict[str, Any]]:
        from kubernetes.client.rest import ApiException
        from urllib3.exceptions import HTTPError

        try:
            response = call(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
            return json.loads(response.data)
        except ApiException as error:
            # 404: this API version is not served (an older Kueue, no visibility API): nothing to say.
            if error.status != 404 and what not in self._unreadable:  # once: a missing Role stays missing
                self._unreadable.add(what)
                self.log(f"(cannot read Kueue's {what} in namespace {self.namespace}: {error.status} {error.reason}; "
                         "the wait is reported from the job's conditions only)")
            return None
        except HTTPError:
            return None

    def find(self, job_uid: str) -> Optional[Dict[str, Any]]:
        """The job's Workload, or None (not created yet, or unreadable)."""
        for version in [self._version] if self._version else KUEUE_VERSIONS:
            listing = self._call("workloads", self.custom.list_namespaced_custom_object, KUEUE_GROUP, version, self.namespace,
                                 WORKLOADS, label_selector=f"{JOB_UID_LABEL}={job_uid}")
            if listing is None:
                continue
            self._version = version
            for item in listing.get("items") or []:
                if any(ref.get("uid") == job_uid for ref in (item.get("metadata") or {}).get("ownerReferences") or []):
                    return item
            return None
        return None

    def position(self, workload_name: str) -> Optional[int]:
        """The Workload's ``positionInLocalQueue`` from the visibility API, or None."""
        path = (f"/apis/{VISIBILITY_GROUP}/{self._version}/namespaces/{{namespace}}/localqueues/{{name}}"
                "/pendingworkloads")
        api_client = self.custom.api_client
        summary = self._call("pending workloads", api_client.call_api, path, "GET",
                             {"namespace": self.namespace, "name": self.queue}, response_type="object",
                             auth_settings=["BearerToken"], header_params={"Accept": "application/json"},
                             _return_http_data_only=True)
        for item in (summary or {}).get("items") or []:
            if (item.get("metadata") or {}).get("name") == workload_name:
                return item.get("positionInLocalQueue")
        return None

    def poll(self, job_name: str, job_uid: Optional[str], force: bool = False) -> str:
        """Reads the Workload (at most every ``interval_s`` unless ``force``), logs a changed reason; returns it."""
        now = time.monotonic()
        if not job_uid or (not force and self._read_at is not None and now - self._read_at < self.interval_s):
            return self.last
        self._read_at = now
        workload = self.find(job_uid)
        if workload is None:
            return self.last
        text = f"Workload {workload['metadata']['name']}: {workload_reason(workload)}"
        position = self.position(workload["metadata"]["name"])
        if position is not None:
            text += f"; {position} workload(s) ahead of it in LocalQueue {self.queue}"
        if text != self.last:
            self.last = text
            self.log(f"[{job_name}] waiting in queue {self.queue}: {text}")
        return self.last


__all__ = ["QueueReporter", "workload_reason"]
