"""The parts of the local API server (fake_kube) that ``domino launch check``'s admission path, the launcher's
queue reports and Kubeflow's SDK read, modelled on the real API server:

* **Creates with ``dryRun=All``** run the whole admission chain and store nothing (kubernetes v1.32
  ``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/create.go``: decode, mutating admission, validating
  admission, then ``r.Create`` with ``options.DryRun``, which the registry's ``DryRunnableStorage`` answers
  without writing, ``pkg/registry/generic/registry/dryrun.go``). ``dryRun`` takes only ``All``
  (``apimachinery/pkg/apis/meta/v1/validation`` ``ValidateDryRun``: "Unsupported value").
* **Field validation** of a custom resource (``apiextensions-apiserver/pkg/apiserver/customresource_handler.go``
  ``unstructuredDecoder``): fields the CRD's structural schema does not declare are pruned; with
  ``fieldValidation=Strict`` the create is refused instead, 400 BadRequest ``<Kind> in version "<v>" cannot be
  handled as a <Kind>: strict decoding error: unknown field "<path>"`` (``runtime.NewStrictDecodingError``).
  The schema served is the CRD in ``../shared/schemas`` (:attr:`AdmissionState.crd_schemas`); a test serves an
  older CRD by editing it (a Trainer before v2.2 had no ``spec.runtimePatches``).
* **Pod Security** on a pod create in a namespace labelled ``pod-security.kubernetes.io/enforce: restricted``:
  403 Forbidden ``pods "<name>" is forbidden: violates PodSecurity "restricted:latest": ...``
  (``k8s.io/pod-security-admission`` ``admission/admission.go``), checked by ``tests/k8s/pod_security.py``.
* Reads: Deployments (``apps/v1``), StorageClasses, ClusterTrainingRuntimes, the Trainer's public ConfigMap
  (404 here, as on a Trainer without it), Kueue Workloads listed by label and the visibility API's
  ``pendingworkloads`` of a LocalQueue (kueue v0.19.2 ``pkg/visibility``, ``PendingWorkloadsSummary``).
"""

from __future__ import annotations

import copy
import functools
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional
from urllib.parse import parse_qs, urlparse

import yaml

SCHEMAS = Path(__file__).resolve().parents[3] / "shared/schemas"
#: Job plural -> (CRD file, version, kind).
CRDS = {"pytorchjobs": (SCHEMAS / "kubeflow.org_pytorchjobs.yaml", "v1", "PyTorchJob"),
        "trainjobs": (SCHEMAS / "trainer-v2.3.0/trainer.kubeflow.org_trainjobs.yaml", "v1alpha1", "TrainJob")}
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"


@functools.lru_cache(maxsize=None)
def _served_schema(plural: str) -> Dict[str, Any]:
    path, version, _ = CRDS[plural]
    crd = yaml.safe_load(path.read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


def crd_schema(plural: str) -> Dict[str, Any]:
    """The served schema of the job CRD (a copy a test may edit, the CRD of another version)."""
    return copy.deepcopy(_served_schema(plural))


def prune(obj: Any, schema: Dict[str, Any], path: str = "") -> List[str]:
    """Drops from ``obj`` (in place) what the structural schema does not declare and returns the dropped paths,
    as apiextensions' ``structuralpruning.PruneWithOptions`` (``x-kubernetes-preserve-unknown-fields`` keeps
    everything below it; ``metadata`` of the root object is ObjectMeta, not pruned by the schema)."""
    dropped: List[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return dropped
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key in list(obj):
            where = f"{path}.{key}" if path else key
            if not path and key in ("apiVersion", "kind", "metadata"):
                continue
            if props is not None and key in props:
                dropped += prune(obj[key], props[key], where)
            elif isinstance(extra, dict):
                dropped += prune(obj[key], extra, where)
            elif props is not None or extra is False:
                del obj[key]
                dropped.append(where)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(obj):
            dropped += prune(item, schema["items"], f"{path}[{index}]")
    return dropped


def _status(code: int, reason: str, message: str) -> Dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message,
            "code": code}


class AdmissionState:
    """What the readers above find (a mixin of fake_kube.FakeCluster; :meth:`init_admission` fills it)."""

    def init_admission(self) -> None:
        # (namespace, name) -> (available replicas, container args): the controllers as their manifests install
        # them (training-operator v1.9.0 ``kubeflow/training-operator`` with k8s/operator's flag; Trainer v2.3.0
        # and JobSet in ``kubeflow-system``; Kueue v0.19.2 ``kueue-system/kueue-controller-manager``).
        self.deployments = {
            ("kubeflow", "training-operator"): (1, ["--pytorch-init-container-template-file="
                                                    "/etc/domino/pytorch-init/initContainer.yaml"]),
            ("kubeflow-system", "kubeflow-trainer-controller-manager"): (1, []),
            ("kubeflow-system", "jobset-controller-manager"): (1, []),
            ("kueue-system", "kueue-controller-manager"): (1, ["--config=/controller_manager_config.yaml"]),
        }
        self.storage_classes = {"standard": "Immediate", "local-path": "WaitForFirstConsumer"}
        self.crd_schemas = {plural: _served_schema(plural) for plural in CRDS}  # a test replaces one to edit it
        self.field_validation = True  # honours fieldValidation (kube-apiserver 1.25 on; older ones ignore it)
        self.namespace_labels = {"domino": {ENFORCE_LABEL: "restricted"}}
        self.workloads: Dict[tuple, Dict[str, Any]] = {}  # (namespace, name) -> Workload
        self.pending: Dict[tuple, List[str]] = {}  # (namespace, LocalQueue) -> pending workload names, in order
        self.visibility = True  # the visibility API is served (Kueue's VisibilityOnDemand)
        self.cluster_runtimes: Dict[str, Dict[str, Any]] = {}
        self.dry_runs: List[Dict[str, Any]] = []  # what each dry run answered

    def set_workload(self, ns: str, job: Dict[str, Any], conditions: List[tuple], queue: str = "team-a") -> str:
        """The Workload Kueue's reconciler creates for ``job`` (``jobframework/reconciler.go``
        ``constructWorkload``: named by ``GetWorkloadNameForOwnerWithGVK``, owned by the job, labelled
        ``kueue.x-k8s.io/job-uid``) with conditions (type, status, reason, message); returns its name."""
        meta = job["metadata"]
        kind = job["kind"]
        name = f"{kind.lower()}-{meta['name']}-{uuid.uuid5(uuid.NAMESPACE_OID, meta['uid']).hex[:5]}"
        with self.cond:
            self.workloads[(ns, name)] = {
                "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                "metadata": {"name": name, "namespace": ns, "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
                             "ownerReferences": [{"apiVersion": job["apiVersion"], "kind": kind, "name": meta["name"],
                                                  "uid": meta["uid"], "controller": True}]},
                "spec": {"queueName": queue},
                "status": {"conditions": [{"type": t, "status": s, "reason": r, "message": m}
                                          for t, s, r, m in conditions]}}
            self.cond.notify_all()
        return name


class AdmissionHandler:
    """The handler side (a mixin of fake_kube._Handler)."""

    def _query(self) -> Dict[str, str]:
        return {k: v[-1] for k, v in parse_qs(urlparse(self.path).query).items()}

    def admission_get(self) -> bool:
        """Answers the reads of the module docstring; False when the path is not one of them."""
        c, parts = self.cluster, urlparse(self.path).path.rstrip("/").split("/")
        if parts[1:3] == ["apis", "apps"] and len(parts) == 8 and parts[6] == "deployments":
            c.requests.append(("apps", "deployments", "get"))
            found = c.deployments.get((parts[5], parts[7]))
            if found is None:
                return self._gone(f'deployments.apps "{parts[7]}" not found')
            available, args = found
            return self._send(200, {"apiVersion": "apps/v1", "kind": "Deployment",
                                    "metadata": {"name": parts[7], "namespace": parts[5]},
                                    "spec": {"replicas": 1, "template": {"spec": {"containers": [
                                        {"name": "manager", "image": "controller", "args": args}]}}},
                                    "status": {"replicas": 1, "availableReplicas": available}}) or True
        if parts[1:3] == ["apis", "storage.k8s.io"] and len(parts) == 6:
            c.requests.append(("storage.k8s.io", "storageclasses", "get"))
            mode = c.storage_classes.get(parts[5])
            if mode is None:
                return self._gone(f'storageclasses.storage.k8s.io "{parts[5]}" not found')
            return self._send(200, {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                                    "metadata": {"name": parts[5]}, "provisioner": "example.com/csi",
                                    "volumeBindingMode": mode}) or True
        if parts[1:3] == ["apis", "trainer.kubeflow.org"] and len(parts) == 6 and parts[4] == "clustertrainingruntimes":
            c.requests.append(("trainer.kubeflow.org", "clustertrainingruntimes", "get"))
            runtime = c.cluster_runtimes.get(parts[5])
            if runtime is None:
                return self._gone(f'clustertrainingruntimes.trainer.kubeflow.org "{parts[5]}" not found')
            return self._send(200, runtime) or True
        if parts[1:3] == ["api", "v1"] and len(parts) == 7 and parts[5] == "configmaps":
            return self._gone(f'configmaps "{parts[6]}" not found')
        if parts[1:3] == ["apis", "kueue.x-k8s.io"] and len(parts) == 7 and parts[6] == "workloads":
            c.requests.append(("kueue.x-k8s.io", "workloads", "list"))
            if (parts[2], parts[3]) not in c.served:
                return self._gone("the server could not find the requested resource")
            wanted = dict(kv.partition("=")[::2] for kv in self._query().get("labelSelector", "").split(",") if kv)
            with c.cond:
                items = [copy.deepcopy(w) for (ns, _), w in c.workloads.items()
                         if ns == parts[5] and wanted.items() <= w["metadata"]["labels"].items()]
            return self._send(200, {"apiVersion": f"kueue.x-k8s.io/{parts[3]}", "kind": "WorkloadList",
                                    "items": items, "metadata": {"resourceVersion": str(c.rv)}}) or True
        if parts[1:3] == ["apis", "visibility.kueue.x-k8s.io"] and len(parts) == 9 and parts[8] == "pendingworkloads":
            c.requests.append(("visibility.kueue.x-k8s.io", "localqueues/pendingworkloads", "get"))
            if not c.visibility:
                return self._gone("the server could not find the requested resource")
            names = c.pending.get((parts[5], parts[7]), [])
            return self._send(200, {"apiVersion": f"visibility.kueue.x-k8s.io/{parts[3]}",
                                    "kind": "PendingWorkloadsSummary", "metadata": {},
                                    "items": [{"metadata": {"name": n, "namespace": parts[5]}, "priority": 0,
                                               "localQueueName": parts[7], "positionInLocalQueue": i,
                                               "positionInClusterQueue": i} for i, n in enumerate(names)]}) or True
        return False

    def _gone(self, message: str) -> bool:
        self._send(404, _status(404, "NotFound", message))
        return True

    def decode(self, body: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Field validation of a job create: prunes undeclared fields, or (``Strict``) answers 400 with them;
        returns the refusal sent, or None. An unsupported ``dryRun`` value is refused with 400 as well."""
        query = self._query()
        if query.get("dryRun") not in (None, "All"):
            return self._refuse(400, "BadRequest", f'dryRun: Unsupported value: "{query["dryRun"]}": supported '
                                'values: "All"')
        schema = self.cluster.crd_schemas[self.resource]
        dropped = prune(body, schema)
        if dropped and query.get("fieldValidation") == "Strict" and self.cluster.field_validation:
            _, version, kind = CRDS[self.resource]
            fields = ", ".join(f'unknown field "{d}"' for d in dropped)
            return self._refuse(400, "BadRequest", f'{kind} in version "{version}" cannot be handled as a {kind}: '
                                f'strict decoding error: {fields}')
        return None

    def _refuse(self, code: int, reason: str, message: str) -> Dict[str, Any]:
        answer = _status(code, reason, message)
        self._send(code, answer)
        return answer

    def dry_run_answer(self, body: Dict[str, Any]) -> bool:
        """For a ``dryRun=All`` create, answers 201 with the admitted object, not stored; False otherwise."""
        if self._query().get("dryRun") != "All":
            return False
        answer = copy.deepcopy(body)
        answer["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=answer["metadata"].get(
            "creationTimestamp") or "2026-01-01T00:00:00Z")
        self.cluster.dry_runs.append(copy.deepcopy(answer))
        self._send(201, answer)
        return True

    def pod_create(self, ns: str, body: Dict[str, Any]) -> None:
        """A pod create: RBAC aside, only dry runs are modelled (Pod Security admission, then nothing stored)."""
        from k8s.pod_security import restricted_violations

        self.cluster.requests.append(("", "pods", "create"))
        if self._query().get("dryRun") != "All":
            self._refuse(405, "MethodNotAllowed", "the local API server only dry-runs pods")
            return
        level = self.cluster.namespace_labels.get(ns, {}).get(ENFORCE_LABEL)
        violations = restricted_violations(body) if level == "restricted" else []
        if violations:
            self._refuse(403, "Forbidden", f'pods "{body["metadata"]["name"]}" is forbidden: violates PodSecurity '
                         f'"restricted:latest": {"; ".join(violations)}')
            return
        self.dry_run_answer(body)


__all__ = ["AdmissionHandler", "AdmissionState", "crd_schema", "prune"]
