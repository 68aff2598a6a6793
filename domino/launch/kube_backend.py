"""Runs a JobSpec as a Kubernetes job (PyTorchJob or TrainJob) with the ``kubernetes`` client and follows it
to the end.

Everything that depends on the job API (the object, how its status reads, its pods, its events) comes
from the :class:`~domino.launch.job_api_base.JobApi` the launcher is given. What it does, in order:

1. Renders the job for the run id (the same run id gives the same name) with an owner reference to
   the launching pod when ``POD_NAME``/``POD_UID`` are set (downward API).
2. Creates it; on 409 adopts the existing job only if its ``domino/run-id`` annotation is this run's
   (and makes the launching pod its owner in place of the earlier attempt's pod), and refuses (never
   touches) a job of another run.
3. Watches the job (field selector on its name) with resourceVersion bookkeeping: a dropped connection
   resumes from the last version, a 410 Gone relists. Condition changes are reported as they happen;
   the rank-0 pod's log is streamed by :class:`~domino.launch.kube_pods.MasterLogStreamer`.
4. Ends on Succeeded (success) or Failed; on the scheduling timeout, counted from admission (job not
   Running yet, or Running without all its pods: the training operator marks a PyTorchJob Running when
   its Master runs, and pods a controller could not create show only as events); on the queue
   timeout while Kueue holds the job suspended; on the overall wall-clock timeout; or on
   SIGTERM/SIGINT. Then it collects the failed pods' logs and deletes the job per the cleanup mode (a
   job given up on is deleted unless ``never``). The scheduling clock stands still while pods pull their
   image or wait for a node scale-up (:mod:`domino.launch.deadlines`).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, Optional, Tuple

from domino.launch import naming
from domino.launch.outcome import JobResult, LaunchInterrupted, interrupt_on_signals, should_delete
from domino.launch.job_api import DEFAULT_JOB_API, JobApi, job_api
from domino.launch.job_api_base import STARTED_PHASES
from domino.launch.deadlines import MAX_PAUSE_S, Deadlines
from domino.launch.kube_pods import (MasterLogStreamer, exit_code, explain_pending, failed_pod_logs, list_job_pods,
                                     pod_waits)
from domino.launch.kueue_workload import QueueReporter
from domino.launch.ownership import adopt_owner, owner_reference
from domino.launch.spec import JobSpec, LaunchSpecError

#: Reasons for which the launcher gives up on a job that may still hold or wait for resources.
GIVEN_UP = ("Timeout", "SchedulingTimeout", "QueueTimeout", "IncompleteReplicas", "NotQueued")


class JobTracker:
    """Follows a job's status (read by its API), reporting each condition change once."""

    def __init__(self, name: str, log: Callable[[str], None], api: JobApi) -> None:
        self.name, self.log, self.api = name, log, api
        self.phase = "Pending"
        self.started = False
        self.suspended = False
        self.uid: Optional[str] = None
        self.failure = ""
        self._reported: Dict[str, Tuple[str, str]] = {}

    def update(self, job: Dict[str, Any]) -> None:
        """Takes the job's latest status (and its suspension: Kueue holds a queued job suspended)."""
        state = self.api.state(job)
        self.suspended = state.suspended
        self.uid = (job.get("metadata") or {}).get("uid") or self.uid
        for cond in state.conditions:
            ctype, status = cond.get("type", ""), cond.get("status", "")
            if status == "True" and self._reported.get(ctype) != (status, cond.get("reason", "")):
                self.log(f"[{self.name}] {ctype}: {cond.get('reason', '')} {cond.get('message', '')}".rstrip())
            self._reported[ctype] = (status, cond.get("reason", ""))
        # A started job does not go back to Created (a TrainJob's node Job is not ready while a pod restarts).
        if state.phase and not (state.phase == "Created" and self.started):
            self.phase = state.phase
        self.failure = state.failure
        self.started = self.started or self.phase in STARTED_PHASES

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def failure_reason(self) -> str:
        return self.failure or "Failed: the job failed"


def load_api_client():
    """An ApiClient from the in-cluster service account, else from the kubeconfig ($KUBECONFIG)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as error:  # one line, not the client's traceback
            raise LaunchSpecError(f"no cluster to talk to: no in-cluster service account and no usable kubeconfig "
                                  f"({error}); set KUBECONFIG, or run inside the cluster") from None
    return client.ApiClient()


def api_error_text(error) -> str:
    """``403 Forbidden: <the API server's message>`` from a kubernetes ApiException."""
    message = ""
    try:
        message = json.loads(error.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        message = str(error.body or "")
    return f"{error.status} {error.reason}" + (f": {message}" if message else "")


class JobConflict(Exception):
    """A job with our name exists and belongs to another run."""


class JobLauncher:
    """Creates or adopts a job of one API and follows it to the end.

    Args:
        api: the job API (default: :data:`~domino.launch.job_api.DEFAULT_JOB_API`).
        api_client: a ``kubernetes.client.ApiClient``; default: in-cluster config, else kubeconfig.
        log: receives status messages and the rank-0 pod's log lines.
        poll_s: how often pods are polled for the log stream, and the shortest watch read timeout.
        watch_timeout_s: server-side length of one watch request (reconnected with the last version).
        request_timeout_s: timeout of each non-streaming API request.
        log_tail_lines: log lines kept for the result.
        log_grace_s: how long the log stream may drain after the job ended.
        max_pause_s: the most the scheduling clock stands still for image pulls and scale-ups, in all.
        queue_poll_s: how often a suspended ``--queue`` job's Kueue Workload is read (domino.launch.kueue_workload).
    """

    def __init__(self, api: Optional[JobApi] = None, api_client=None, log: Callable[[str], None] = print,
                 poll_s: float = 2.0, watch_timeout_s: float = 60.0, request_timeout_s: float = 30.0,
                 log_tail_lines: int = 50, log_grace_s: float = 10.0, max_pause_s: float = MAX_PAUSE_S,
                 queue_poll_s: float = 10.0) -> None:
        self.max_pause_s, self.queue_poll_s = max_pause_s, queue_poll_s
        self._queue: Optional[QueueReporter] = None
        self.api = api or job_api(DEFAULT_JOB_API)
        self.log = log
        self.poll_s, self.watch_timeout_s, self.request_timeout_s = poll_s, watch_timeout_s, request_timeout_s
        self.log_tail_lines, self.log_grace_s = log_tail_lines, log_grace_s
        from kubernetes import client

        self.api_client = api_client or load_api_client()
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)

    # -- API calls -------------------------------------------------------------------------------------
    def _resource(self, namespace: str) -> Tuple[str, str, str, str]:
        """(group, version, namespace, plural): the CustomObjectsApi coordinates of the job."""
        return self.api.group, self.api.version, namespace, self.api.plural

    def create_or_adopt(self, body: Dict[str, Any], run_id: str) -> Tuple[Dict[str, Any], bool]:
        """Creates the job; on 409 returns the existing job if it is this run's, else raises JobConflict.
        Returns the job as the API server stored it (after mutating webhooks) and whether it was created."""
        from kubernetes.client.rest import ApiException

        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            job = self.custom.create_namespaced_custom_object(*self._resource(ns), body,
                                                              _request_timeout=self.request_timeout_s)
            self.log(f"created {self.api.kind} {ns}/{name} (run {run_id})")
            return job, True
        except ApiException as error:
            if error.status != 409:
                raise
        existing = self.custom.get_namespaced_custom_object(*self._resource(ns), name,
                                                            _request_timeout=self.request_timeout_s)
        meta = existing.get("metadata") or {}
        theirs = (meta.get("annotations") or {}).get(naming.RUN_ID_ANNOTATION)
        if theirs == run_id and (meta.get("labels") or {}).get(naming.RUN_ID_LABEL) == naming.label_value(run_id):
            self.log(f"adopting existing {self.api.kind} {ns}/{name} of this run ({run_id}): a retry resumes it")
            owner = (body["metadata"].get("ownerReferences") or [None])[0]
            if owner:
                existing = adopt_owner(self.custom, self.api, existing, owner, self.log, self.request_timeout_s)
            return existing, False
        raise JobConflict(f"a {self.api.kind} named {name} already exists in namespace {ns} and belongs to run "
                          f"{theirs!r}, not to this run {run_id!r}; refusing to reuse it (delete it, or use "
                          f"another --name or --run-id)")

    def delete(self, namespace: str, name: str) -> None:
        """Deletes the job and (background propagation) its pods; a missing job is fine."""
        from kubernetes.client.rest import ApiException

        try:
            self.custom.delete_namespaced_custom_object(*self._resource(namespace), name,
                                                        propagation_policy="Background",
                                                        _request_timeout=self.request_timeout_s)
            self.log(f"deleted {self.api.kind} {namespace}/{name}")
        except ApiException as error:
            if error.status != 404:
                raise

    def relist(self, namespace: str, name: str) -> Tuple[Optional[Dict[str, Any]], str]:
        """The job (None when gone) and the list's resourceVersion to watch from."""
        listing = self.custom.list_namespaced_custom_object(*self._resource(namespace),
                                                            field_selector=f"metadata.name={name}",
                                                            _request_timeout=self.request_timeout_s)
        items = listing.get("items") or []
        return (items[0] if items else None), listing["metadata"]["resourceVersion"]

    # -- the run ---------------------------------------------------------------------------------------
    def run(self, spec: JobSpec, run_id: Optional[str] = None, timeout_s: Optional[float] = None,
            scheduling_timeout_s: float = 600, cleanup: str = "on-success",
            queue_timeout_s: Optional[float] = None) -> JobResult:
        """Runs ``spec`` as a job of this launcher's API to completion (see the module docstring)."""
        from kubernetes.client.rest import ApiException
        from urllib3.exceptions import HTTPError

        run_id = run_id or naming.new_run_id()
        start = time.monotonic()
        body = self.api.render(spec, run_id, owner_reference(spec.namespace, self.log))
        ns, name = spec.namespace, body["metadata"]["name"]
        tracker = JobTracker(name, self.log, self.api)
        self._queue = QueueReporter(self.custom, ns, spec.queue, self.log, self.request_timeout_s,
                                    self.queue_poll_s) if spec.queue else None
        streamer = MasterLogStreamer(self.core, ns, self.api, name, self.log, self.log_tail_lines, self.poll_s,
                                     self.request_timeout_s)
        owned, interrupted, result = False, False, None
        with interrupt_on_signals() as shield:
            try:
                try:
                    job, created = self.create_or_adopt(body, run_id)
                except JobConflict as error:
                    return JobResult(name, False, "Conflict", f"Conflict: {error}", [], None)
                owned = True
                tracker.update(job)
                if created and spec.queue and not tracker.suspended:
                    result = self._not_queued(name)
                    return result
                streamer.start()
                result = self._follow(job, tracker, Deadlines(start, timeout_s, scheduling_timeout_s, queue_timeout_s,
                                                                self.max_pause_s),
                                      spec.nodes)
            except ApiException as error:
                result = JobResult(name, False, tracker.phase, f"ApiError: {api_error_text(error)}", [], None)
            except HTTPError as error:
                result = JobResult(name, False, tracker.phase,
                                   f"ApiUnreachable: the Kubernetes API did not answer: {error}", [], None)
            except LaunchInterrupted as error:
                interrupted = True
                self.log(f"launcher interrupted ({error}); stopping job {name}")
                result = JobResult(name, False, tracker.phase, f"Interrupted: the launcher {error}", [], None)
            finally:
                shield()  # further signals must not abort the cleanup
                if streamer.is_alive():
                    streamer.finish(self.log_grace_s if result is not None and tracker.terminal else 0.0)
                if result is not None:
                    self._complete(result, streamer, ns, name)
                # A job given up on (timeout, never scheduled) still holds or waits for GPUs: stop it too.
                reason = result.reason.partition(":")[0] if result is not None else ""
                stopped = interrupted or reason in GIVEN_UP
                if owned and should_delete(cleanup, bool(result and result.succeeded), stopped,
                                           outside_quota=reason == "NotQueued"):
                    try:
                        self.delete(ns, name)
                    except (ApiException, HTTPError) as error:  # report it; the job outcome stands
                        text = api_error_text(error) if isinstance(error, ApiException) else str(error)
                        self.log(f"could not delete {self.api.kind} {ns}/{name}: {text}")
                        if result is not None:
                            result.reason += f" (and deleting the job failed: {text})"
                elif owned:
                    self.log(f"keeping {self.api.kind} {ns}/{name} (--cleanup {cleanup})")
        return result

    def _not_queued(self, name: str) -> JobResult:
        """The result for a ``--queue`` job that the API server stored unsuspended: Kueue did not take it.

        The job is created unsuspended: Kueue's mutating webhook suspends every job of an enabled
        integration that carries the queue-name label (kubernetes-sigs/kueue v0.19.2
        ``pkg/controller/jobframework/base_webhook.go`` ``Default`` -> ``defaults.go``
        ``ApplyDefaultForSuspend``, ``utils.go`` ``WorkloadShouldBeSuspended``), before the object is
        stored. Unsuspended means no webhook ran: Kueue is not installed, or this kind's integration is
        off (v0.19.2's default ``controller_manager_config.yaml`` ships ``kubeflow.org/pytorchjob``
        commented out), so no Workload will be created and the job would run outside the queue's quota.
        """
        framework = f"{self.api.group}/{self.api.kind.lower()}"
        return JobResult(name, False, "Created", f"NotQueued: Kueue did not suspend the {self.api.kind} at creation, "
                         f"so it is not managed by Kueue and no Workload will admit it: enable the \"{framework}\" "
                         "integration (integrations.frameworks in Kueue's controller_manager_config.yaml, see "
                         "docs/cluster.md) or submit without --queue", [], None)

    def _follow(self, job: Dict[str, Any], tracker: JobTracker, clock: "Deadlines", nodes: int) -> JobResult:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException
        from urllib3.exceptions import HTTPError, ReadTimeoutError

        meta = job["metadata"]
        ns, name, version = meta["namespace"], meta["name"], meta.get("resourceVersion", "")
        all_running = False  # every pod of the job seen Running once
        while not tracker.terminal:
            result = self._check(clock, tracker, ns, name, nodes, all_running)
            if result is True:
                all_running = True
                continue
            if result is not None:
                return result
            was_suspended = tracker.suspended
            read_timeout = clock.read_timeout(tracker.suspended, all_running, self.watch_timeout_s, self.poll_s)
            if tracker.suspended and self._queue:  # the Workload changes without the job: read it on time
                read_timeout = min(read_timeout, max(self.poll_s, self._queue.interval_s))
            try:
                stream = watch.Watch().stream(
                    self.custom.list_namespaced_custom_object, *self._resource(ns),
                    field_selector=f"metadata.name={name}", resource_version=version,
                    timeout_seconds=max(1, int(self.watch_timeout_s)),
                    _request_timeout=(self.request_timeout_s, read_timeout))
                for event in stream:
                    obj = event["object"]
                    if not isinstance(obj, dict):
                        obj = self.api_client.sanitize_for_serialization(obj)
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    if event["type"] == "DELETED":
                        return JobResult(name, False, tracker.phase,
                                         f"Deleted: the {self.api.kind} was deleted while running", [], None)
                    tracker.update(obj)
                    if tracker.terminal or tracker.suspended != was_suspended or clock.passed():
                        break
            except ApiException as error:
                if error.status != 410:
                    raise
                self.log(f"[{name}] watch expired (410 Gone); relisting")
                current, version = self.relist(ns, name)
                if current is None:
                    return JobResult(name, False, tracker.phase,
                                     f"Deleted: the {self.api.kind} was deleted while running", [], None)
                tracker.update(current)
            except (HTTPError, OSError) as error:
                if not isinstance(error, ReadTimeoutError) and "Read timed out" not in str(error):
                    self.log(f"[{name}] watch connection lost ({type(error).__name__}); reconnecting")
                    time.sleep(min(self.poll_s, 1.0))
        if tracker.phase == "Succeeded":
            return JobResult(name, True, "Succeeded", "", [], None)
        return JobResult(name, False, "Failed", tracker.failure_reason(), [], None)

    def _check(self, clock: "Deadlines", tracker: JobTracker, ns: str, name: str, nodes: int, all_running: bool):
        """A result when a deadline has passed, True when every pod is Running (checked once, at the
        scheduling deadline), else None. At the scheduling deadline, pods pulling their image or waiting for a
        scale-up stop the clock for a step (domino.launch.deadlines)."""
        now = time.monotonic()
        if clock.end is not None and now >= clock.end:
            return JobResult(name, False, tracker.phase, f"Timeout: the job did not finish within "
                             f"{clock.timeout_s:g} s (phase {tracker.phase})", [], None)
        if clock.queue_timed_out(tracker.suspended, now):
            why = self._queue.poll(name, tracker.uid, force=True) if self._queue else ""
            return JobResult(name, False, "Suspended", f"QueueTimeout: the job waited in queue (suspended, "
                             f"not admitted) for {clock.queue_timeout_s:g} s" + (f"; Kueue: {why}" if why else ""),
                             [], None)
        if tracker.suspended:  # waiting in the queue: the scheduling clock starts when admitted
            if self._queue:
                self._queue.poll(name, tracker.uid)  # logs Kueue's reason when it changes
            clock.scheduling_end = None
            return None
        if clock.scheduling_end is None:
            clock.scheduling_end = now + clock.scheduling_timeout_s
        if all_running or now < clock.scheduling_end:
            return None
        # A job shows Running as soon as one pod runs (the training operator: its Master; a TrainJob: any
        # active pod); pods a controller could not create appear only as events.
        pods = list_job_pods(self.core, ns, self.api, name, self.request_timeout_s)
        running = [p for p in pods if (p.get("status") or {}).get("phase") in ("Running", "Succeeded")]
        if tracker.started and len(running) >= nodes:
            return True
        waits = pod_waits(self.core, ns, pods, self.request_timeout_s)
        if waits and clock.pause(waits[0][0]):  # pulling or scaling up: the clock stands still
            for _, text in waits:
                self.log(f"[{name}] scheduling clock paused: {text}")
            return None
        why = "; ".join(explain_pending(self.core, ns, self.api, name, self.request_timeout_s))
        why = why or "no events explain it"
        after = f"{clock.scheduling_timeout_s:g} s{clock.not_counted()}"
        if tracker.started:
            return JobResult(name, False, tracker.phase, f"IncompleteReplicas: only {len(running)} of {nodes} pods "
                             f"were running after {after}: {why}", [], None)
        return JobResult(name, False, tracker.phase,
                         f"SchedulingTimeout: the job was still {tracker.phase} (not Running) after {after}: {why}",
                         [], None)

    def _complete(self, result: JobResult, streamer: MasterLogStreamer, ns: str, name: str) -> None:
        """Fills the log tail and the Master's exit code into ``result`` (best effort)."""
        result.log_tail = list(streamer.tail)
        pod, pods = streamer.pod, []
        try:
            pods = list_job_pods(self.core, ns, self.api, name, self.request_timeout_s)
            pod = self.api.rank0_pod(pods, name) or pod
        except Exception:  # the job may be gone already; keep what the streamer saw
            pass
        result.exit_code = exit_code(pod, self.api.container)
        if result.succeeded:
            return
        result.failed_pods = failed_pod_logs(self.core, ns, pods, self.api.container, self.log_tail_lines, self.request_timeout_s)
        master_tail = result.failed_pods.pop(pod["metadata"]["name"], []) if pod is not None else []
        result.log_tail = result.log_tail or master_tail


__all__ = ["JobConflict", "JobLauncher", "JobTracker", "load_api_client", "owner_reference"]

