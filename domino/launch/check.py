"""``domino launch check``: asks the API server, before anything is submitted, whether what the job needs is there.

Each check is one read the API server answers for any authenticated user or through the launcher Role
(``k8s/base/launcher-rbac.yaml``), and each problem is one line naming the object and what is wrong:

* the job API's custom resource is served: API discovery, ``GET /apis/<group>/<version>`` (allowed to
  every authenticated user by the ``system:discovery`` ClusterRole), lists ``pytorchjobs`` or ``trainjobs``;
* with ``--api trainjob``, the TrainingRuntime the TrainJob names exists in the namespace (else the
  Trainer's webhook refuses the TrainJob, see domino.launch.trainjob);
* the claim exists, is ``Bound`` (``status.phase``) and offers ``ReadWriteMany`` (``status.accessModes``,
  what the bound volume provides; ``spec.accessModes`` while it is unbound), since every node mounts it; a
  ``Pending`` claim of a StorageClass with ``volumeBindingMode: WaitForFirstConsumer`` is fine: it binds when
  the first pod that mounts it is scheduled (kubernetes ``pkg/controller/volume/persistentvolume``
  ``pv_controller.go`` ``shouldDelayBinding``);
* with ``--queue``, Kueue's LocalQueue exists and is ``Active`` (kueue v0.19.2 ``apis/kueue/v1beta2``
  ``LocalQueueActive``; v1beta1 on a Kueue older than v0.15; False with ``ClusterQueueDoesNotExist`` when its ClusterQueue is missing); with ``--api trainjob``, no ResourceFlavor of
  its ClusterQueue has tolerations that would replace the job's at admission (:meth:`ClusterCheck.flavors`);
* every call the launcher makes is allowed: one SelfSubjectAccessReview (authorization.k8s.io/v1, which
  any authenticated user may create) per (group, resource, verb) of :func:`launcher_calls` (with ``--queue``,
  the reads of the job's Kueue Workload too);
* the admission path (:mod:`domino.launch.check_admission`): the controllers' Deployments are available, the
  training operator has domino's template flag, and server-side dry runs of the rendered job and of a Worker
  pod pass the webhooks, field validation and Pod Security, with Kueue suspending a queued job.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from domino.launch.check_admission import AdmissionCheck, call_json, error_message
from domino.launch.job_api_base import JobApi
from domino.launch.spec import JobSpec

#: Kueue's LocalQueue, newest version first: v1beta2 exists from Kueue v0.15.0 on (v0.19.2 serves both, v1beta2
#: stored), v1beta1 alone before it (kubernetes-sigs/kueue#7626, the v0.15.0 release notes, plan to drop v1beta1
#: in v0.17). Both carry the ``Active`` condition read below.
KUEUE_GROUP, KUEUE_VERSIONS, LOCAL_QUEUES = "kueue.x-k8s.io", ("v1beta2", "v1beta1"), "localqueues"
#: Kueue's cluster-scoped ClusterQueues and ResourceFlavors (kueue v0.19.2 ``apis/kueue/v1beta2``).
CLUSTER_QUEUES, FLAVORS = "clusterqueues", "resourceflavors"
#: TrainingRuntimes (the Trainer v2.3.0 CRD).
RUNTIMES = "trainingruntimes"
#: The core calls the launcher makes in the job's namespace (its job API's are added per API).
CORE_CALLS: Tuple[Tuple[str, str, str], ...] = (
    ("", "pods", "list"), ("", "pods/log", "get"), ("", "events", "list"))
#: The verbs the launcher uses on its job resource (create, adopt, follow, re-parent on adoption, delete).
JOB_VERBS = ("create", "get", "list", "watch", "patch", "delete")


#: What the launcher reads while a ``--queue`` job waits (domino.launch.kueue_workload).
QUEUE_CALLS: Tuple[Tuple[str, str, str], ...] = (
    (KUEUE_GROUP, "workloads", "list"), ("visibility.kueue.x-k8s.io", "localqueues/pendingworkloads", "get"))


def launcher_calls(api: JobApi, queued: bool = False) -> List[Tuple[str, str, str]]:
    """(group, resource, verb) of every call the launcher makes for ``api`` (what its Role must grant), with
    ``queued`` those of a job waiting in a Kueue queue too."""
    return [(api.group, api.plural, verb) for verb in JOB_VERBS] + list(CORE_CALLS) + list(QUEUE_CALLS if queued else ())


def _toleration_key(toleration: Dict[str, Any]) -> Tuple[str, str, str, str]:
    """A toleration as (key, operator, value, effect), the API's defaults filled (operator Equal)."""
    return (toleration.get("key") or "", toleration.get("operator") or "Equal", toleration.get("value") or "",
            toleration.get("effect") or "")


class ClusterCheck:
    """Runs the checks of the module docstring against one API server (``api_client``)."""

    def __init__(self, api: JobApi, api_client, request_timeout_s: float = 30.0) -> None:
        from kubernetes import client

        self.api, self.timeout = api, request_timeout_s
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.authz = client.AuthorizationV1Api(api_client)

    def _get(self, call: Callable, *args) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        """(object, None), or (None, ``"404 Not Found: ..."``) when the API server refuses the read."""
        found, error = call_json(call, *args, timeout=self.timeout)
        return found, None if error is None else f"{error.status} {error.reason}: {error_message(error)}"

    def served(self, group: str, version: str, plural: str, what: str) -> List[str]:
        found, error = self._get(self.custom.get_api_resources, group, version)
        names = {r.get("name") for r in (found or {}).get("resources") or []}
        if plural in names:
            return []
        return [f"{what}: the API server does not serve {plural}.{group}/{version} "
                f"({error or 'not in the group version'}): is it installed?"]

    def runtime(self, spec: JobSpec, name: str) -> List[str]:
        from domino.launch.trainjob import GROUP, VERSION

        _, error = self._get(self.custom.get_namespaced_custom_object, GROUP, VERSION, spec.namespace, RUNTIMES, name)
        return [] if error is None else [f"TrainingRuntime {spec.namespace}/{name}: {error} (kubectl apply -k "
                                         "k8s/overlays/gpu-trainer, or a kfp overlay, installs it)"]

    def claim(self, spec: JobSpec) -> List[str]:
        pvc, error = self._get(self.core.read_namespaced_persistent_volume_claim, spec.pvc, spec.namespace)
        where = f"PersistentVolumeClaim {spec.namespace}/{spec.pvc}"
        if error is not None:
            return [f"{where}: {error}"]
        status = pvc.get("status") or {}
        out = []
        if status.get("phase") == "Pending" and self.binds_on_first_pod(pvc):
            status = {**status, "phase": "Bound"}  # binds when the job's first pod is scheduled
        if status.get("phase") != "Bound":
            out.append(f"{where}: not Bound (phase {status.get('phase') or 'unknown'}): no volume provisioned yet; "
                       "check its events and that its storage class exists")
        modes = status.get("accessModes") or (pvc.get("spec") or {}).get("accessModes") or []
        if "ReadWriteMany" not in modes:
            out.append(f"{where}: access modes {modes} lack ReadWriteMany: every node of the job mounts it")
        return out

    def binds_on_first_pod(self, pvc: Dict[str, Any]) -> bool:
        """Whether the claim's StorageClass delays binding to the first consumer (read failures: no)."""
        name = (pvc.get("spec") or {}).get("storageClassName")
        if not name:
            return False
        from kubernetes import client

        found, _ = self._get(client.StorageV1Api(self.custom.api_client).read_storage_class, name)
        return (found or {}).get("volumeBindingMode") == "WaitForFirstConsumer"

    def kueue_version(self) -> Tuple[Optional[str], List[str]]:
        """The newest LocalQueue version the API server serves, or None and the one-line problem."""
        newest_missing: List[str] = []
        for version in KUEUE_VERSIONS:
            missing = self.served(KUEUE_GROUP, version, LOCAL_QUEUES, "Kueue")
            if not missing:
                return version, []
            newest_missing = newest_missing or missing  # reported for the newest version, asked once
        return None, newest_missing

    def queue(self, spec: JobSpec, version: str) -> List[str]:
        queue, error = self._get(self.custom.get_namespaced_custom_object, KUEUE_GROUP, version,
                                 spec.namespace, LOCAL_QUEUES, spec.queue)
        where = f"LocalQueue {spec.namespace}/{spec.queue}"
        if error is not None:
            return [f"{where}: {error}"]
        active = next((c for c in (queue.get("status") or {}).get("conditions") or [] if c.get("type") == "Active"),
                      None)
        if active is None or active.get("status") != "True":
            why = f"{active.get('reason')}: {active.get('message', '')}" if active else "no Active condition"
            return [f"{where}: not Active ({why})"]
        cluster_queue = (queue.get("spec") or {}).get("clusterQueue")
        return self.flavors(spec, version, cluster_queue) if self.api.name == "trainjob" and cluster_queue else []

    def flavors(self, spec: JobSpec, version: str, cluster_queue: str) -> List[str]:
        """The ResourceFlavors the queue can admit a TrainJob to whose tolerations would replace the job's.

        Kueue's runtime patch comes after domino's (kueue v0.19.2 ``pkg/controller/jobs/trainjob/
        trainjob_webhook.go`` ``Default``) and carries the flavor's tolerations (``trainjob_controller.go``
        ``RunWithPodSetsInfo``, ``pkg/podset/podset.go`` ``FromAssignment``); Trainer v2.3.0 applies the patches
        in order as strategic merges (``pkg/runtime/core/trainingruntime.go`` ``mergeRuntimePatches``) and
        ``tolerations`` has no merge key (core/v1 ``PodSpec``): a flavor with tolerations replaces the job's,
        one without leaves them (tests/launch/test_launch_kueue_tolerations.py models the merge).
        """
        from domino.launch.defaults import tolerations

        where = f"ClusterQueue {cluster_queue}"
        found, error = self._get(self.custom.get_cluster_custom_object, KUEUE_GROUP, version, CLUSTER_QUEUES,
                                 cluster_queue)
        if error is not None:
            return [f"{where}: {error}: cannot see its ResourceFlavors' tolerations (k8s/launch-check grants the "
                    "read)"]
        names = dict.fromkeys(flavor.get("name") for group in (found.get("spec") or {}).get("resourceGroups") or []
                              for flavor in group.get("flavors") or [])
        wanted = [t.to_dict() for t in tolerations(spec)]
        out = []
        for name in filter(None, names):
            flavor, error = self._get(self.custom.get_cluster_custom_object, KUEUE_GROUP, version, FLAVORS, name)
            if error is not None:
                out.append(f"ResourceFlavor {name} ({where}): {error}: cannot see its tolerations (k8s/launch-check "
                           "grants the read)")
                continue
            theirs = [_toleration_key(t) for t in (flavor.get("spec") or {}).get("tolerations") or []]
            dropped = [t for t in wanted if theirs and _toleration_key(t) not in theirs
                       and ("", "Exists", "", "") not in theirs and ("", "Exists", "", t.get("effect", "")) not in theirs]
            if dropped:
                listed = ", ".join(f"{t['key']}" + (f"={t['value']}" if t.get("value") else "") +
                                   (f":{t['effect']}" if t.get("effect") else "") for t in dropped)
                out.append(f"ResourceFlavor {name} ({where}): its tolerations replace the TrainJob's when Kueue "
                           f"admits it there (trainer v2.3.0 mergeRuntimePatches), dropping {listed}: add them to "
                           f"the flavor's spec.tolerations (as k8s/queue/resourceflavor-gpu.yaml does)")
        return out

    def access(self, namespace: str, queued: bool = False) -> List[str]:
        out = []
        for group, resource, verb in launcher_calls(self.api, queued):
            resource, _, subresource = resource.partition("/")
            attributes = {"namespace": namespace, "verb": verb, "group": group, "resource": resource}
            if subresource:
                attributes["subresource"] = subresource
            body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                    "spec": {"resourceAttributes": attributes}}
            review, error = self._get(self.authz.create_self_subject_access_review, body)
            allowed = (review or {}).get("status", {}).get("allowed")
            if not allowed:
                name = f"{resource}/{subresource}" if subresource else resource
                why = error or (review or {}).get("status", {}).get("reason") or "not allowed"
                out.append(f"RBAC: cannot {verb} {name}" + (f".{group}" if group else "")
                           + f" in namespace {namespace} ({why}): bind the domino-launcher Role (k8s/base)")
        return out

    def run(self, spec: JobSpec, run_id: Optional[str] = None) -> List[str]:
        """Every problem found, one line each (empty: the cluster has what the job needs); ``run_id`` names the
        dry-run job as submit would."""
        from domino.launch.trainjob import RUNTIME_NAME

        problems = self.served(self.api.group, self.api.version, self.api.plural, self.api.kind)
        no_runtime = self.runtime(spec, RUNTIME_NAME) if self.api.name == "trainjob" else []
        problems += no_runtime + self.claim(spec)
        if spec.queue:
            version, missing = self.kueue_version()
            problems += missing or self.queue(spec, version)
        problems += self.access(spec.namespace, bool(spec.queue))
        if problems and problems[0].startswith(f"{self.api.kind}: the API server does not serve"):
            return problems  # no CRD: a dry run would only repeat it
        body = self.api.render(spec, run_id or "launch-check", None)
        # Without its runtime the Trainer's webhook refuses the dry run for the reason already given.
        return problems + AdmissionCheck(self.api, self.custom.api_client, self.timeout).run(spec, body,
                                                                                            job=not no_runtime)
