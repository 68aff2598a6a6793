"""``domino launch check`` on the real admission path: what the API server and the controllers' webhooks would
do with the job, asked without creating anything.

* **A server-side dry run** of the rendered job: ``POST ...?dryRun=All&fieldValidation=Strict``. The API server
  runs the whole create (decoding with field validation, mutating then validating admission webhooks) and
  stores nothing (kubernetes ``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/create.go``; the
  registry's ``DryRunnableStorage``, ``pkg/registry/generic/registry/dryrun.go``). Webhooks declared
  ``sideEffects: None`` run on dry runs, as all of Kueue v0.19.2's, Trainer v2.3.0's and training-operator
  v1.9.0's do (their ``webhook/manifests.yaml``, copies in ``../shared/upstream``). Read from the answer:

  - a refusal: a webhook's (``admission webhook "..." denied the request: ...``) or strict field validation's
    (``strict decoding error: unknown field "spec.runtimePatches"``: the served CRD lacks a field the job
    sets, e.g. a Trainer older than v2.2, which had ``podTemplateOverrides`` instead of ``runtimePatches``);
  - pruned fields, for a server that ignores ``fieldValidation``: paths sent but not returned;
  - with ``--queue``, Kueue's suspension: Kueue's mutating webhook suspends every job of an enabled
    integration that carries ``kueue.x-k8s.io/queue-name`` (kueue v0.19.2
    ``pkg/controller/jobframework/base_webhook.go`` ``Default`` -> ``ApplyDefaultForSuspend``). The webhook is
    registered only for enabled integrations, so a dry-run answer still unsuspended means the kind's
    integration is off (or Kueue is not installed): the job would run outside the queue.

* **A dry run of a Worker pod** (PyTorchJob: the Worker replica's template; TrainJob: none, the Trainer
  builds its pods from the runtime) in the job's namespace, which runs Pod Security admission: a refusal
  (``violates PodSecurity "restricted:latest"``) is reported as is. The operator's init container is not in
  the template: the template-flag check below covers it.

* **Controller readiness**: ``status.availableReplicas`` of each controller Deployment the job needs
  (:data:`CONTROLLERS`), read with ``k8s/launch-check``'s ClusterRole; and for a PyTorchJob, the training
  operator's ``--pytorch-init-container-template-file`` flag, without which every Worker gets the operator's
  default init container, which Pod Security "restricted" refuses (training-operator v1.9.0
  ``pkg/controller.v1/pytorch/initcontainer.go``; ``k8s/operator`` sets it).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Tuple

from domino.launch.job_api_base import JobApi
from domino.launch.spec import JobSpec

#: (namespace, Deployment) of each controller, as its manifests install it: training-operator v1.9.0
#: (``manifests/overlays/standalone``: namespace ``kubeflow``, ``base/deployment.yaml``), Trainer v2.3.0 and the
#: JobSet it installs (``manifests/overlays/manager``: ``kubeflow-system``), Kueue v0.19.2 (``kueue-system``,
#: the ``kueue-`` name prefix on ``controller-manager``).
CONTROLLERS = {
    "pytorchjob": [("kubeflow", "training-operator")],
    "trainjob": [("kubeflow-system", "kubeflow-trainer-controller-manager"),
                 ("kubeflow-system", "jobset-controller-manager")],
    "kueue": [("kueue-system", "kueue-controller-manager")],
}
#: The training operator's flag naming the init-container template (``cmd/training-operator.v1/main.go``).
TEMPLATE_FLAG = "--pytorch-init-container-template-file"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def error_message(error) -> str:
    """The API server's message in a refusal (its Status body), else the HTTP reason."""
    try:
        return json.loads(error.body or "{}").get("message", "") or str(error.reason)
    except (ValueError, AttributeError):
        return str(getattr(error, "reason", error))


def call_json(call: Callable, *args, timeout: float, **kwargs) -> Tuple[Optional[Dict[str, Any]], Optional[Any]]:
    """(the answer as JSON, None), or (None, the ApiException) when the API server refuses the call."""
    from kubernetes.client.rest import ApiException

    try:
        response = call(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
        return json.loads(response.data), None
    except ApiException as error:
        return None, error


def dropped_paths(sent: Any, returned: Any, path: str = "") -> List[str]:
    """Paths present in ``sent`` but missing from ``returned`` (what the API server pruned)."""
    if isinstance(sent, dict) and isinstance(returned, dict):
        out = []
        for key, value in sent.items():
            where = f"{path}.{key}" if path else key
            out += [where] if key not in returned else dropped_paths(value, returned[key], where)
        return out
    if isinstance(sent, list) and isinstance(returned, list) and len(sent) == len(returned):
        return [p for i, (a, b) in enumerate(zip(sent, returned)) for p in dropped_paths(a, b, f"{path}[{i}]")]
    return []


def suspended(api: JobApi, job: Dict[str, Any]) -> bool:
    spec = job.get("spec") or {}
    return bool((spec.get("runPolicy") or {}).get("suspend") if api.name == "pytorchjob" else spec.get("suspend"))


def worker_pod(job: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A Worker pod as the training operator would create it from the PyTorchJob's Worker template."""
    replicas = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    replica = replicas.get("Worker") or replicas.get("Master")
    if replica is None:
        return None
    template = replica["template"]
    meta = template.get("metadata") or {}
    role = "worker" if "Worker" in replicas else "master"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{job['metadata']['name']}-{role}-0", "namespace": job["metadata"]["namespace"],
                         "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}},
            "spec": template["spec"]}


class AdmissionCheck:
    """The checks of the module docstring, through a ``kubernetes`` ApiClient."""

    def __init__(self, api: JobApi, api_client, request_timeout_s: float = 30.0) -> None:
        from kubernetes import client

        self.api, self.timeout = api, request_timeout_s
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)

    def _call(self, call, *args, **kwargs) -> Tuple[Optional[Dict[str, Any]], Optional[Any]]:
        return call_json(call, *args, timeout=self.timeout, **kwargs)

    def dry_run_job(self, spec: JobSpec, body: Dict[str, Any]) -> List[str]:
        what = f"{self.api.kind} {spec.namespace}/{body['metadata']['name']} (dry run)"
        answer, error = self._call(self.custom.create_namespaced_custom_object, self.api.group, self.api.version,
                                   spec.namespace, self.api.plural, body, dry_run="All", field_validation="Strict")
        if error is not None:
            text = error_message(error)
            hint = (": the served CRD lacks a field this domino sets (a Trainer older than v2.2 has no "
                    "runtimePatches): upgrade the controller's CRDs" if "unknown field" in text else "")
            return [f"{what}: {error.status} {error.reason}: {text}{hint}"]
        out = []
        dropped = [p for p in dropped_paths(body, answer) if not p.startswith(("metadata", "status"))]
        if dropped:
            out.append(f"{what}: the API server dropped {', '.join(dropped)} (not in its CRD): the job would run "
                       "without them; upgrade the controller's CRDs")
        if spec.queue and not suspended(self.api, answer):
            framework = f"{self.api.group}/{self.api.kind.lower()}"
            out.append(f"{what}: Kueue did not suspend it: the \"{framework}\" integration is off (integrations."
                       "frameworks in Kueue's controller_manager_config.yaml) or Kueue is not installed, so the job "
                       "would run outside queue " + spec.queue)
        return out

    def dry_run_pod(self, spec: JobSpec, body: Dict[str, Any]) -> List[str]:
        pod = worker_pod(body) if self.api.name == "pytorchjob" else None
        if pod is None:
            return []
        _, error = self._call(self.core.create_namespaced_pod, spec.namespace, pod, dry_run="All",
                              field_validation="Strict")
        if error is None:
            return []
        return [f"Pod {spec.namespace}/{pod['metadata']['name']} (dry run of a Worker): {error.status} "
                f"{error.reason}: {error_message(error)}"]

    def controllers(self, spec: JobSpec) -> List[str]:
        wanted = CONTROLLERS[self.api.name] + (CONTROLLERS["kueue"] if spec.queue else [])
        out = []
        for namespace, name in wanted:
            deployment, error = self._call(self.apps.read_namespaced_deployment, name, namespace)
            where = f"Deployment {namespace}/{name}"
            if error is not None:
                hint = (": bind k8s/launch-check's ClusterRole to see controllers" if error.status == 403
                        else ": is the controller installed (docs/cluster.md, Install)?")
                out.append(f"{where}: {error.status} {error.reason}: {error_message(error)}{hint}")
                continue
            available = (deployment.get("status") or {}).get("availableReplicas") or 0
            if available < 1:
                out.append(f"{where}: no available replica (the controller is down: kubectl -n {namespace} "
                           f"describe deployment {name})")
            if name == "training-operator":
                args = [a for c in deployment["spec"]["template"]["spec"]["containers"]
                        for a in (c.get("command") or []) + (c.get("args") or [])]
                if not any(a == TEMPLATE_FLAG or a.startswith(TEMPLATE_FLAG + "=") for a in args):
                    out.append(f"{where}: runs without {TEMPLATE_FLAG}: every Worker gets the operator's default "
                               "init container, which Pod Security \"restricted\" refuses (apply k8s/operator)")
        return out

    def run(self, spec: JobSpec, body: Dict[str, Any], job: bool = True) -> List[str]:
        """Every problem found, one line each (``job``: dry-run the job too)."""
        return self.controllers(spec) + (self.dry_run_job(spec, body) if job else []) + self.dry_run_pod(spec, body)


__all__ = ["AdmissionCheck", "CONTROLLERS", "TEMPLATE_FLAG", "dropped_paths", "worker_pod"]
