"""A tiny Kubernetes API server for the launcher tests, driven by the real ``kubernetes`` client.

It implements only what the launcher calls: PyTorchJobs and TrainJobs (create, get, list, watch,
patch, delete), pods (list by label selector, ``k=v[,k=v]``), pod logs (plain, tail and follow, with
timestamps) and events (list by involved object). Tests script a job's life with :class:`FakeCluster`
methods (conditions, pods, log lines, watch disconnects, history compaction); every request is recorded
as (group, resource, verb) for the RBAC check. A TrainJob naming a runtime the cluster does not have
is refused as the Trainer's validating webhook refuses it (see :data:`TRAINJOB_WEBHOOK`). Kueue's mutating
webhook suspends a job carrying the queue-name label when its integration is enabled (see
:data:`KUEUE_FRAMEWORKS`): by default the integrations of Kueue v0.19.2's shipped configuration.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, urlparse

import yaml

from fake_admission import AdmissionHandler, AdmissionState
from fake_faults import FaultHandler

#: URL prefix -> (API group, resource) of the job resources served.
JOB_RESOURCES = {"/apis/kubeflow.org/v1/namespaces/": ("kubeflow.org", "pytorchjobs"),
                 "/apis/trainer.kubeflow.org/v1alpha1/namespaces/": ("trainer.kubeflow.org", "trainjobs")}
CORE_PREFIX = "/api/v1/namespaces/"
#: The Trainer v2.3.0 validating webhook (pkg/webhooks/trainjob_webhook.go); controller-runtime answers a
#: denial with 403 and this message prefix (webhook/admission: ``Denied``).
TRAINJOB_WEBHOOK = "validator.trainjob.trainer.kubeflow.org"
#: Kueue v0.19.2's default configuration (config/components/manager/controller_manager_config.yaml).
KUEUE_CONFIG = Path(__file__).resolve().parents[3] / "shared/upstream/kueue-v0.19.2/controller_manager_config.yaml"
#: Job resource -> Kueue integration name (kueue v0.19.2 ``pkg/controller/jobs/*``: the framework names).
KUEUE_FRAMEWORKS = {"pytorchjobs": "kubeflow.org/pytorchjob", "trainjobs": "trainer.kubeflow.org/trainjob"}
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def kueue_frameworks(config_text: Optional[str] = None) -> set:
    """The enabled ``integrations.frameworks`` of a Kueue configuration (default: v0.19.2's shipped one)."""
    config = yaml.safe_load(config_text if config_text is not None else KUEUE_CONFIG.read_text())
    return set((config.get("integrations") or {}).get("frameworks") or [])


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as ``evanphx/json-patch``'s ``MergePatch`` (which the API server applies
    for ``application/merge-patch+json``, ``apiserver/pkg/endpoints/handlers/patch.go``): objects merge key
    by key, ``null`` deletes a key, anything else (lists included) replaces the old value whole."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _status(code: int, reason: str, message: str) -> Dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message,
            "code": code}


class FakeCluster(AdmissionState):
    """In-memory API state plus the knobs tests use to script a job."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.jobs: Dict[Tuple[str, str], Dict[str, Any]] = {}
        self.pods: Dict[Tuple[str, str], Dict[str, Any]] = {}
        self.events: List[Dict[str, Any]] = []
        self.logs: Dict[str, List[Tuple[str, str]]] = {}
        self.log_closed: Dict[str, bool] = {}
        self.history: List[Tuple[int, str, Dict[str, Any]]] = []
        self.rv = 100
        self.compacted_below = 0
        self.watch_generation = 0  # bumping it cuts every open watch mid-stream
        self.requests: List[Tuple[str, str, str]] = []
        self.deleted: List[str] = []
        self.pod_deletes: List[str] = []  # pods deleted through the API (fake_faults)
        self.sent: List[Dict[str, Any]] = []  # job bodies as created by the client, before any webhook
        self.on_create = None  # callable(cluster, job) run in a thread after a create
        self.forbid_create = False  # answer creates with 403 (RBAC missing)
        self.forbid_patch = False  # answer patches with 403 (RBAC without patch)
        self.before_patch = None  # callable(cluster, ns, name) run before a patch applies (a concurrent writer)
        self.runtimes = {"domino-torch-distributed"}  # TrainingRuntimes installed in every namespace
        self.kueue_frameworks = kueue_frameworks()  # Kueue installed with its default integrations
        # What `domino launch check` reads (the API server's answers modelled below, see _check_get):
        self.served = {("kubeflow.org", "v1"): ["pytorchjobs"],  # API discovery: group/version -> resources
                       ("trainer.kubeflow.org", "v1alpha1"): ["trainjobs", "trainingruntimes"],
                       ("kueue.x-k8s.io", "v1beta2"): ["localqueues", "clusterqueues", "workloads", "resourceflavors"]}
        # Kueue's cluster-scoped objects: ClusterQueue -> the flavors of its resource groups; flavor -> its spec.
        self.cluster_queues = {"cluster-queue": ["default-flavor"]}
        self.flavors: Dict[str, Dict[str, Any]] = {"default-flavor": {}}
        self.pvcs = {"domino-data": {"phase": "Bound", "accessModes": ["ReadWriteMany"]}}  # claim -> status
        self.local_queues = {"team-a": ("True", "Ready", "Can submit new workloads to localQueue")}
        self.denied = set()  # (group, resource[/subresource], verb) the caller's RBAC does not allow
        self._pod_suffix: Dict[Tuple[str, str], str] = {}
        self.init_admission()  # dry runs, controllers, storage classes, Workloads (fake_admission)

    # -- scripting --------------------------------------------------------------------------------------
    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _record(self, kind: str, job: Dict[str, Any]) -> None:
        job["metadata"]["resourceVersion"] = self._bump()
        self.history.append((self.rv, kind, copy.deepcopy(job)))
        self.cond.notify_all()

    def add_job(self, job: Dict[str, Any]) -> Dict[str, Any]:
        """Stores a job as if created (also used to plant a pre-existing job)."""
        with self.cond:
            job = copy.deepcopy(job)
            job["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_now())
            # Both CRDs have a status subresource: a create's status is dropped, and an empty status is
            # omitted (a TrainJob's status has minProperties 1).
            job.pop("status", None)
            self.jobs[(job["metadata"]["namespace"], job["metadata"]["name"])] = job
            self._record("ADDED", job)
            return copy.deepcopy(job)

    def set_condition(self, ns: str, name: str, ctype: str, reason: str = "", message: str = "") -> None:
        """Sets condition ``ctype`` True the way the operator does (Running/Restarting exclusive, etc.)."""
        with self.cond:
            job = self.jobs.get((ns, name))
            if job is None:  # deleted meanwhile: the operator has nothing to update
                return
            conds = job.setdefault("status", {}).setdefault("conditions", [])
            if ctype in ("Succeeded", "Failed", "Restarting"):
                for c in conds:
                    if c["type"] == "Running":
                        c["status"] = "False"
            if ctype == "Running":
                for c in conds:
                    if c["type"] == "Restarting":
                        c["status"] = "False"
            conds[:] = [c for c in conds if c["type"] != ctype]
            conds.append({"type": ctype, "status": "True", "reason": reason, "message": message,
                          "lastTransitionTime": _now()})
            self._record("MODIFIED", job)

    def set_suspend(self, ns: str, name: str, suspend: bool) -> None:
        """Sets ``spec.runPolicy.suspend`` (what Kueue does on admission) and the operator's Suspended
        condition (kubeflow/trainer release-1.9 ``pkg/controller.v1/common/job.go``: Suspended True while
        suspended, False with reason Resumed after)."""
        with self.cond:
            job = self.jobs.get((ns, name))
            if job is None:
                return
            job["spec"].setdefault("runPolicy", {})["suspend"] = suspend
            conds = job.setdefault("status", {}).setdefault("conditions", [])
            for c in conds:  # a running job that is suspended stops Running (common/job.go, same branch)
                if suspend and c["type"] == "Running":
                    c["status"] = "False"
            conds[:] = [c for c in conds if c["type"] != "Suspended"]
            conds.append({"type": "Suspended", "status": "True" if suspend else "False",
                          "reason": "PyTorchJobSuspended" if suspend else "PyTorchJobResumed",
                          "message": f"PyTorchJob {name} is {'suspended' if suspend else 'resumed'}.",
                          "lastTransitionTime": _now()})
            self._record("MODIFIED", job)

    def delete_pods(self, ns: str, job: str) -> None:
        """Deletes every pod of ``job``, as the controllers do when it is suspended (the training operator's
        ``DeletePodsAndServices``; a suspended JobSet's Jobs)."""
        with self.cond:
            for key in [k for k in self.pods if k[0] == ns and k[1].startswith(job + "-")]:
                del self.pods[key]
            self.cond.notify_all()

    def add_pod(self, ns: str, job: str, replica: str, index: int, phase: str = "Pending",
                state: Optional[Dict[str, Any]] = None, conditions: Optional[List[Dict[str, Any]]] = None,
                restarts: int = 0) -> str:
        """Creates or replaces the PyTorchJob pod ``<job>-<replica>-<index>``; returns its name."""
        labels = {"training.kubeflow.org/job-name": job, "training.kubeflow.org/replica-type": replica,
                  "training.kubeflow.org/replica-index": str(index)}
        return self._put_pod(ns, f"{job}-{replica}-{index}", labels, "pytorch", phase, state, conditions, restarts)

    def add_node_pod(self, ns: str, job: str, index: int, phase: str = "Pending",
                     state: Optional[Dict[str, Any]] = None, conditions: Optional[List[Dict[str, Any]]] = None,
                     restarts: int = 0) -> str:
        """Creates or replaces pod ``index`` of a TrainJob's ``node`` Job, as the JobSet (v0.12.0
        ``labelAndAnnotateObject``) and the Job controller (indexed pods ``<job>-node-0-<index>-<random>``,
        ``indexed_job_utils.go``) make it, with the container ``node``; returns its name."""
        with self.cond:
            suffix = self._pod_suffix.setdefault((ns, f"{job}/{index}"), uuid.uuid4().hex[:5])
        labels = {"jobset.sigs.k8s.io/jobset-name": job, "jobset.sigs.k8s.io/replicatedjob-name": "node",
                  "jobset.sigs.k8s.io/job-index": "0", "jobset.sigs.k8s.io/restart-attempt": "0",
                  "batch.kubernetes.io/job-completion-index": str(index), "job-name": f"{job}-node-0",
                  "batch.kubernetes.io/job-name": f"{job}-node-0"}
        return self._put_pod(ns, f"{job}-node-0-{index}-{suffix}", labels, "node", phase, state, conditions, restarts)

    def _put_pod(self, ns, name, labels, container, phase, state, conditions, restarts) -> str:
        with self.cond:
            old = self.pods.get((ns, name))
            self.pods[(ns, name)] = {
                "metadata": {"name": name, "namespace": ns, "uid": old["metadata"]["uid"] if old else str(uuid.uuid4()),
                             "labels": labels},
                "status": {"phase": phase, "conditions": conditions or [],
                           "containerStatuses": [{"name": container, "restartCount": restarts,
                                                  "state": state or {"waiting": {"reason": "ContainerCreating"}}}]},
            }
            self.logs.setdefault(name, [])
            self.cond.notify_all()
        return name

    # -- the Trainer v2.3.0 controller's status updates (a TrainJob) --------------------------------------
    def set_trainjob_status(self, ns: str, name: str, active: int = 0, ready: int = 0, succeeded: int = 0,
                            failed: int = 0, suspended: int = 0, condition: Optional[Tuple[str, str, str]] = None
                            ) -> None:
        """Sets ``status.jobsStatus`` for the ``node`` Job (the JobSet's replicatedJobsStatus, copied by
        trainer ``plugins/jobset`` ``Status``) and, optionally, condition (type, reason, message) True:
        Complete or Failed as copied from the JobSet. No Created or Running condition exists in v2.3.0."""
        with self.cond:
            job = self.jobs.get((ns, name))
            if job is None:
                return
            job.setdefault("status", {})["jobsStatus"] = [{"name": "node", "active": active, "ready": ready, "succeeded": succeeded,
                                            "failed": failed, "suspended": suspended}]
            if condition is not None:
                ctype, reason, message = condition
                conds = job.setdefault("status", {}).setdefault("conditions", [])
                conds[:] = [c for c in conds if c["type"] != ctype]
                conds.append({"type": ctype, "status": "True", "reason": reason, "message": message,
                              "lastTransitionTime": _now()})
            self._record("MODIFIED", job)

    def set_trainjob_suspend(self, ns: str, name: str, suspend: bool) -> None:
        """``spec.suspend`` (Kueue's admission clears it) and the controller's Suspended condition
        (trainjob_controller.go ``setSuspendedCondition``: True/Suspended "TrainJob is suspended" while
        suspended, then False/Resumed "TrainJob is resumed")."""
        with self.cond:
            job = self.jobs.get((ns, name))
            if job is None:
                return
            job["spec"]["suspend"] = suspend
            conds = job.setdefault("status", {}).setdefault("conditions", [])
            was = any(c["type"] == "Suspended" and c["status"] == "True" for c in conds)
            if suspend or was:
                conds[:] = [c for c in conds if c["type"] != "Suspended"]
                conds.append({"type": "Suspended", "status": "True" if suspend else "False",
                              "reason": "Suspended" if suspend else "Resumed",
                              "message": "TrainJob is suspended" if suspend else "TrainJob is resumed",
                              "lastTransitionTime": _now()})
            self._record("MODIFIED", job)

    def add_event(self, ns: str, obj: str, reason: str, message: str, etype: str = "Warning") -> None:
        """A core/v1 Event as client-go's recorder writes it (firstTimestamp/lastTimestamp, second precision
        in RFC 3339, so two events of one second tie: the list order breaks the tie, as here)."""
        with self.cond:
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.events.append({"metadata": {"name": f"{obj}.{uuid.uuid4().hex[:8]}", "namespace": ns},
                                "involvedObject": {"name": obj, "namespace": ns}, "reason": reason,
                                "message": message, "type": etype, "firstTimestamp": stamp, "lastTimestamp": stamp})

    def log(self, pod: str, *lines: str) -> None:
        with self.cond:
            for line in lines:
                self.logs.setdefault(pod, []).append((_now(), line))
                time.sleep(0.001)  # distinct timestamps
            self.cond.notify_all()

    def close_log(self, pod: str, closed: bool = True) -> None:
        """Marks the container's log finished (follow streams end) or reopened (a restart)."""
        with self.cond:
            self.log_closed[pod] = closed
            self.cond.notify_all()

    def cut_watches(self) -> None:
        """Breaks every open watch connection (no final chunk: the client sees a protocol error)."""
        with self.cond:
            self.watch_generation += 1
            self.cond.notify_all()

    def compact(self) -> None:
        """Forgets history: watches from any version seen so far get 410 Gone."""
        with self.cond:
            self.compacted_below = self.rv + 1

    def wait_for(self, predicate, timeout: float = 10.0) -> None:
        """Waits until ``predicate()`` holds, looking again at every change and at least every 0.1 s: not every
        change notifies (a request is only appended to :attr:`requests`)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError("fake cluster: condition not reached in time")
                self.cond.wait(min(0.1, remaining))

    def verbs(self) -> set:
        return set(self.requests)


class _Handler(AdmissionHandler, FaultHandler, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    cluster: FakeCluster
    resource = ""  # the job resource of the current request (set by _route)

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    # -- plumbing ---------------------------------------------------------------------------------------
    def _send(self, code: int, body: Any) -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _route(self) -> Tuple[str, List[str], Dict[str, str]]:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        for prefix, (group, resource) in JOB_RESOURCES.items():
            if url.path.startswith(prefix):
                self.resource = resource
                return group, url.path[len(prefix):].split("/"), query
        if url.path.startswith(CORE_PREFIX):
            return "", url.path[len(CORE_PREFIX):].split("/"), query
        return "?", url.path.split("/"), query

    def _webhook_denial(self, body: Dict[str, Any]) -> Optional[str]:
        """The Trainer's validating webhook: the referenced TrainingRuntime must exist
        (pkg/runtime/core/trainingruntime.go ``ValidateObjects``)."""
        if self.resource != "trainjobs":
            return None
        ref = body["spec"]["runtimeRef"]
        kind = ref.get("kind") or "ClusterTrainingRuntime"  # the CRD's default (v2.3.0 trainjob_types.go)
        known = self.cluster.runtimes if kind == "TrainingRuntime" else self.cluster.cluster_runtimes
        if ref["name"] not in known:  # clustertrainingruntime.go ValidateObjects words it the same way
            lower = kind[0].lower() + kind[1:]
            return (f'admission webhook "{TRAINJOB_WEBHOOK}" denied the request: spec.runtimeRef: Invalid value: '
                    f'{{"name":"{ref["name"]}","apiGroup":"trainer.kubeflow.org","kind":"{kind}"}}: '
                    f'{kind.lower()}s.trainer.kubeflow.org "{ref["name"]}" not found: specified {lower} '
                    'must be created before the TrainJob is created')
        return None

    def _kueue_default(self, body: Dict[str, Any]) -> None:
        """Kueue's mutating webhook, registered only for enabled integrations: a job with the queue-name
        label is suspended before it is stored (kueue v0.19.2 ``jobframework/base_webhook.go`` ``Default``
        -> ``ApplyDefaultForSuspend``; ``runPolicy.suspend`` for Kubeflow jobs, ``spec.suspend`` for a
        TrainJob, ``trainjob_webhook.go``)."""
        if KUEUE_FRAMEWORKS.get(self.resource) not in self.cluster.kueue_frameworks:
            return
        if not (body["metadata"].get("labels") or {}).get(KUEUE_QUEUE_LABEL):
            return
        if self.resource == "pytorchjobs":
            body["spec"].setdefault("runPolicy", {})["suspend"] = True
        else:
            body["spec"]["suspend"] = True

    # -- verbs ------------------------------------------------------------------------------------------
    def do_POST(self) -> None:
        group, parts, _ = self._route()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        c = self.cluster
        if self.path.startswith("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"):
            return self._access_review(body)
        if group == "" and parts[1:2] == ["pods"]:
            return self.pod_create(parts[0], body)
        c.sent.append(copy.deepcopy(body))
        c.requests.append((group, self.resource, "create"))
        ns, name = parts[0], body["metadata"]["name"]
        # An object without a namespace gets the request's (apiserver handlers/rest.go
        # EnsureObjectNamespaceMatchesRequestNamespace); the Kubeflow SDK sends none.
        body["metadata"]["namespace"] = body["metadata"].get("namespace") or ns
        if c.forbid_create:
            return self._send(403, _status(403, "Forbidden", f'{self.resource}.{group} is forbidden: User '
                                           '"system:serviceaccount:domino:default" cannot create resource'))
        if self.decode(body) is not None:  # field validation (fake_admission), before admission
            return
        self._kueue_default(body)  # mutating admission, then validating (create.go's order)
        denial = self._webhook_denial(body)
        if denial:
            return self._send(403, _status(403, "Forbidden", denial))
        with c.cond:
            exists = (ns, name) in c.jobs
        if exists:
            return self._send(409, _status(409, "AlreadyExists", f'{self.resource}.{group} "{name}" already exists'))
        if self.dry_run_answer(body):
            return
        job = c.add_job(body)
        if c.on_create:
            threading.Thread(target=c.on_create, args=(c, job), daemon=True).start()
        self._send(201, job)

    def do_PATCH(self) -> None:
        """A patch of a job, as the API server answers it for a custom resource (see :func:`merge_patch`)."""
        if self.fault_patch():  # a Kueue Workload (fake_faults)
            return
        group, parts, _ = self._route()
        c = self.cluster
        c.requests.append((group, self.resource, "patch"))
        ns, name = parts[0], parts[2]
        kind = self.headers.get("Content-Type", "").split(";")[0].strip()
        patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if c.forbid_patch:
            return self._send(403, _status(403, "Forbidden", f'{self.resource}.{group} "{name}" is forbidden: User '
                                           '"system:serviceaccount:domino:default" cannot patch resource'))
        if c.before_patch:
            c.before_patch(c, ns, name)
        if kind != "application/merge-patch+json":
            # customresource_handler.go serves json-patch, merge-patch and apply for custom resources;
            # handlers/patch.go answers any other type 415 (strategic merge needs a Go type, which a CR lacks).
            # The launcher sends only merge patches, so json-patch and apply are not modelled here.
            return self._send(415, _status(415, "UnsupportedMediaType",
                                           "the body of the request was in an unknown format - accepted media "
                                           "types include: application/json-patch+json, "
                                           "application/merge-patch+json, application/apply-patch+yaml"))
        with c.cond:
            job = c.jobs.get((ns, name))
            if job is None:
                return self._send(404, _status(404, "NotFound", f'{self.resource}.{group} "{name}" not found'))
            patched = merge_patch(job, patch)
            meta = patched["metadata"]
            # A resourceVersion (or uid) in the patch is a precondition: the store's GuaranteedUpdate refuses a
            # stale one with a Conflict (apiserver/pkg/registry/generic/registry/store.go, OptimisticLockErrorMsg).
            if meta.get("resourceVersion") not in (None, "", job["metadata"]["resourceVersion"]) or \
                    meta.get("uid") != job["metadata"]["uid"]:
                return self._send(409, _status(409, "Conflict", f'Operation cannot be fulfilled on '
                                               f'{self.resource}.{group} "{name}": the object has been modified; '
                                               'please apply your changes to the latest version and try again'))
            for ref in meta.get("ownerReferences") or []:  # ValidateOwnerReferences (apimachinery validation)
                missing = [field for field in ("apiVersion", "kind", "name", "uid") if not ref.get(field)]
                if missing:
                    return self._send(422, _status(422, "Invalid", f"metadata.ownerReferences.{missing[0]}: "
                                                   "Invalid value: \"\": must not be empty"))
            patched["status"] = copy.deepcopy(job.get("status"))  # the status subresource: the main resource's
            if patched["status"] is None:                           # patch leaves status alone
                patched.pop("status")
            c.jobs[(ns, name)] = patched
            c._record("MODIFIED", patched)
            answer = copy.deepcopy(patched)
        self._send(200, answer)

    def do_DELETE(self) -> None:
        group, parts, _ = self._route()
        if self.fault_delete(group, parts):  # a pod (fake_faults)
            return
        c = self.cluster
        c.requests.append((group, self.resource, "delete"))
        ns, name = parts[0], parts[2]
        with c.cond:
            job = c.jobs.pop((ns, name), None)
            if job is not None:
                c.deleted.append(name)
                c._record("DELETED", job)
        if job is None:
            return self._send(404, _status(404, "NotFound", f'{self.resource}.{group} "{name}" not found'))
        self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

    def _check_get(self) -> bool:
        """The reads of ``domino launch check``, answered as the API server answers them: discovery
        (``/apis/<group>/<version>``: an APIResourceList, or 404 NotFound "the server could not find the
        requested resource" for a group version nobody serves), PersistentVolumeClaims, TrainingRuntimes and
        Kueue LocalQueues (404 NotFound ``<plural>.<group> "<name>" not found`` when missing)."""
        c, path = self.cluster, urlparse(self.path).path.rstrip("/")
        parts = path.split("/")
        not_found = "the server could not find the requested resource"
        if len(parts) == 4 and parts[1] == "apis":  # discovery
            group, version = parts[2], parts[3]
            c.requests.append(("discovery", f"{group}/{version}", "get"))
            if (group, version) not in c.served:
                self._send(404, _status(404, "NotFound", not_found))
            else:
                self._send(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}",
                                 "resources": [{"name": r, "namespaced": True, "kind": r.rstrip("s").title()}
                                               for r in c.served[(group, version)]]})
            return True
        if len(parts) == 7 and parts[1:3] == ["api", "v1"] and parts[5] == "persistentvolumeclaims":
            c.requests.append(("", "persistentvolumeclaims", "get"))
            status = c.pvcs.get(parts[6])
            if status is None:
                self._send(404, _status(404, "NotFound", f'persistentvolumeclaims "{parts[6]}" not found'))
            else:
                self._send(200, {"kind": "PersistentVolumeClaim", "apiVersion": "v1",
                                 "metadata": {"name": parts[6], "namespace": parts[4]},
                                 "spec": {"accessModes": status["accessModes"],
                                          "storageClassName": status.get("class", "standard")},
                                 "status": {"phase": status["phase"], "accessModes": status["accessModes"]}
                                 if status["phase"] == "Bound" else {"phase": status["phase"]}})
            return True
        if len(parts) == 6 and parts[1] == "apis" and parts[4] in ("clusterqueues", "resourceflavors"):
            group, plural, name = parts[2], parts[4], parts[5]  # cluster-scoped: no namespace in the path
            c.requests.append((group, plural, "get"))
            found = (c.cluster_queues if plural == "clusterqueues" else c.flavors).get(name)
            if (group, plural, "get") in c.denied:
                self._send(403, _status(403, "Forbidden", f'{plural}.{group} "{name}" is forbidden: User '
                                        f'"system:serviceaccount:domino:domino-pipeline" cannot get resource '
                                        f'"{plural}" in API group "{group}" at the cluster scope'))
            elif found is None:
                self._send(404, _status(404, "NotFound", f'{plural}.{group} "{name}" not found'))
            else:
                spec = ({"resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [
                    {"name": f, "resources": []} for f in found]}]} if plural == "clusterqueues" else found)
                self._send(200, {"apiVersion": f"{group}/{parts[3]}", "kind": "ClusterQueue" if plural ==
                                 "clusterqueues" else "ResourceFlavor", "metadata": {"name": name}, "spec": spec})
            return True
        if len(parts) == 8 and parts[1] == "apis" and parts[6] in ("trainingruntimes", "localqueues"):
            group, plural, name = parts[2], parts[6], parts[7]
            c.requests.append((group, plural, "get"))
            if (group, parts[3]) not in c.served or plural not in c.served[(group, parts[3])]:
                self._send(404, _status(404, "NotFound", not_found))
            elif plural == "trainingruntimes":
                if name not in c.runtimes:
                    self._send(404, _status(404, "NotFound", f'{plural}.{group} "{name}" not found'))
                    return True
                self._send(200, {"apiVersion": f"{group}/{parts[3]}", "kind": "TrainingRuntime",
                                 "metadata": {"name": name, "namespace": parts[5]}, "spec": {}})
            elif name not in c.local_queues:
                self._send(404, _status(404, "NotFound", f'{plural}.{group} "{name}" not found'))
            else:
                status, reason, message = c.local_queues[name]
                self._send(200, {"apiVersion": f"{group}/{parts[3]}", "kind": "LocalQueue",
                                 "metadata": {"name": name, "namespace": parts[5]},
                                 "spec": {"clusterQueue": "cluster-queue"},
                                 "status": {"conditions": [{"type": "Active", "status": status, "reason": reason,
                                                            "message": message}]}})
            return True
        return False

    def _access_review(self, body: Dict[str, Any]) -> None:
        """A SelfSubjectAccessReview: ``status.allowed`` from :attr:`FakeCluster.denied` (RBAC's answer)."""
        c = self.cluster
        c.requests.append(("authorization.k8s.io", "selfsubjectaccessreviews", "create"))
        attrs = body["spec"]["resourceAttributes"]
        resource = attrs["resource"] + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
        allowed = (attrs.get("group", ""), resource, attrs["verb"]) not in c.denied
        status = {"allowed": allowed}
        if allowed:
            status["reason"] = 'RBAC: allowed by RoleBinding "domino-launcher/domino" of Role "domino-launcher"'
        self._send(201, {**body, "metadata": {"creationTimestamp": None}, "status": status})

    def do_GET(self) -> None:
        if self._check_get() or self.admission_get():
            return
        group, parts, query = self._route()
        c = self.cluster
        if group in ("kubeflow.org", "trainer.kubeflow.org"):
            ns = parts[0]
            if len(parts) == 3:
                c.requests.append((group, self.resource, "get"))
                with c.cond:
                    job = copy.deepcopy(c.jobs.get((ns, parts[2])))
                if job is None:
                    return self._send(404, _status(404, "NotFound", f"{parts[2]} not found"))
                return self._send(200, job)
            wanted = query.get("fieldSelector", "").partition("metadata.name=")[2]
            if query.get("watch", "").lower() in ("true", "1"):
                c.requests.append((group, self.resource, "watch"))
                return self._watch(ns, wanted, int(query.get("resourceVersion") or 0),
                                   float(query.get("timeoutSeconds") or 30))
            c.requests.append((group, self.resource, "list"))
            labels = dict(kv.partition("=")[::2] for kv in query.get("labelSelector", "").split(",") if kv)
            with c.cond:
                items = [copy.deepcopy(j) for (n, name), j in c.jobs.items() if n == ns and wanted in ("", name)
                         and labels.items() <= (j["metadata"].get("labels") or {}).items()]
                rv = str(c.rv)
            return self._send(200, {"apiVersion": "v1", "kind": "List", "items": items,
                                    "metadata": {"resourceVersion": rv}})
        if group == "" and parts[1] == "pods" and len(parts) == 2:
            c.requests.append(("", "pods", "list"))
            # Equality-based selectors only: k=v[,k=v...] (all must match).
            wanted = dict(kv.partition("=")[::2] for kv in query.get("labelSelector", "").split(",") if kv)
            with c.cond:
                items = [copy.deepcopy(p) for (n, _), p in c.pods.items()
                         if n == parts[0] and wanted.items() <= p["metadata"]["labels"].items()]
            return self._send(200, {"kind": "PodList", "apiVersion": "v1", "items": items,
                                    "metadata": {"resourceVersion": str(c.rv)}})
        if group == "" and parts[1] == "pods" and len(parts) == 4 and parts[3] == "log":
            c.requests.append(("", "pods/log", "get"))
            return self._logs(parts[2], query)
        if group == "" and parts[1] == "events":
            c.requests.append(("", "events", "list"))
            wanted = query.get("fieldSelector", "").partition("involvedObject.name=")[2]
            with c.cond:
                items = [e for e in c.events if not wanted or e["involvedObject"]["name"] == wanted]
            return self._send(200, {"kind": "EventList", "apiVersion": "v1", "items": items, "metadata": {}})
        self._send(404, _status(404, "NotFound", self.path))

    def _watch(self, ns: str, name: str, since: int, timeout: float) -> None:
        c = self.cluster
        with c.cond:
            if since and since < c.compacted_below:
                gone = True
            else:
                gone = False
                generation = c.watch_generation
        self._start_stream()
        if gone:
            self._chunk(json.dumps({"type": "ERROR", "object": _status(410, "Expired", "too old resource version")})
                        + "\n")
            return self._end_stream()
        end = time.monotonic() + timeout
        sent = since
        try:
            while True:
                with c.cond:
                    pending = [(rv, kind, obj) for rv, kind, obj in c.history
                               if rv > sent and obj["metadata"]["name"] == name and obj["metadata"]["namespace"] == ns]
                    cut = c.watch_generation != generation
                    if not pending and not cut:
                        c.cond.wait(min(0.1, max(0.0, end - time.monotonic())))
                        continue_waiting = time.monotonic() < end
                    else:
                        continue_waiting = True
                if cut:
                    return  # no terminating chunk: a broken connection
                for rv, kind, obj in pending:
                    self._chunk(json.dumps({"type": kind, "object": obj}) + "\n")
                    sent = rv
                if not continue_waiting:
                    return self._end_stream()
        except (BrokenPipeError, ConnectionResetError):
            return

    def _logs(self, pod: str, query: Dict[str, str]) -> None:
        c = self.cluster
        stamps = query.get("timestamps", "").lower() == "true"
        fmt = (lambda ts, line: f"{ts} {line}\n") if stamps else (lambda ts, line: line + "\n")
        with c.cond:
            if pod not in c.logs:
                return self._send(404, _status(404, "NotFound", f"pod {pod} not found"))
            lines = list(c.logs[pod])
        if query.get("follow", "").lower() != "true":
            tail = int(query.get("tailLines", 0) or 0)
            return self._send(200, "".join(fmt(ts, ln) for ts, ln in (lines[-tail:] if tail else lines)))
        self._start_stream()
        sent = 0
        try:
            while True:
                with c.cond:
                    new = c.logs[pod][sent:]
                    closed = c.log_closed.get(pod, False)
                    if not new and not closed:
                        c.cond.wait(0.1)
                        continue
                for ts, line in new:
                    self._chunk(fmt(ts, line))
                sent += len(new)
                if closed and not new:
                    return self._end_stream()
        except (BrokenPipeError, ConnectionResetError):
            return


class FakeKubeServer:
    """Runs a :class:`FakeCluster` behind a local HTTP server; use as a context manager."""

    def __init__(self) -> None:
        self.cluster = FakeCluster()
        handler = type("Handler", (_Handler,), {"cluster": self.cluster})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False  # a watch or log stream still open must not hold the test's exit
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # serve_forever looks for shutdown() every poll interval (0.5 s by default): each test's exit waited for it
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "FakeKubeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def api_client(self):
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        return client.ApiClient(config)

    def kubeconfig(self, path: str) -> str:
        """Writes a kubeconfig pointing at this server; returns its path."""
        import yaml

        with open(path, "w") as handle:
            yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "fake", "user": {"token": "test"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "domino"}}],
            }, handle)
        return path
