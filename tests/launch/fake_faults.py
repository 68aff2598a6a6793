"""What the local API server (fake_kube) answers to the smoke's faults, and the controllers' reactions.

* ``DELETE /api/v1/namespaces/<ns>/pods/<name>``: the pod goes; then the training operator's reaction
  (kubeflow/training-operator v1.9.0 ``pkg/controller.v1/common/pod.go`` ``ReconcilePods``: a replica index
  with no pod gets ``createNewPod``, named ``<job>-<replica>-<index>`` by ``CreatePod``), modelled by
  :func:`operator_recreates`: the same name, a new uid, Pending then Running.
* ``PATCH .../kueue.x-k8s.io/v1beta2/namespaces/<ns>/workloads/<name>`` (merge patch): the Workload is
  patched, then Kueue's reaction (v0.19.2 ``pkg/controller/core/workload_controller.go``): an admitted
  Workload with ``spec.active: false`` is evicted (condition Evicted True, reason ``Deactivated``, "The
  workload is deactivated"), its quota released and admission cleared, and the job reconciler
  (``pkg/controller/jobframework/reconciler.go``) suspends the job, whose controller deletes its pods; a
  deactivated one set active again is requeued (Requeued True, reason ``Reactivated``, "The workload was
  reactivated"), re-admitted and the job unsuspended, modelled by :func:`kueue_reacts`.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Any, Dict, List

WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/"


def _set(conds: List[Dict[str, Any]], ctype: str, status: str, reason: str, message: str) -> None:
    conds[:] = [c for c in conds if c["type"] != ctype]
    conds.append({"type": ctype, "status": status, "reason": reason, "message": message})


def operator_recreates(c, ns: str, pod: Dict[str, Any]) -> None:
    """The operator's ``createNewPod`` for the deleted PyTorchJob pod's replica index, then the kubelet runs it.
    (A TrainJob's pods belong to the Job controller under a JobSet, whose reaction is not modelled here.)"""
    labels = pod["metadata"]["labels"]
    if "training.kubeflow.org/replica-type" not in labels:
        return
    job, replica = labels["training.kubeflow.org/job-name"], labels["training.kubeflow.org/replica-type"]
    index = int(labels["training.kubeflow.org/replica-index"])
    time.sleep(0.05)
    c.add_pod(ns, job, replica, index)  # a new uid: the old pod is gone
    time.sleep(0.05)
    c.add_pod(ns, job, replica, index, "Running", {"running": {"startedAt": "now"}})


def kueue_reacts(c, ns: str, workload: Dict[str, Any], was_active: bool) -> None:
    """Kueue's reconcile of a Workload whose ``spec.active`` changed (see the module docstring)."""
    active = workload["spec"].get("active", True)
    owner = workload["metadata"]["ownerReferences"][0]["name"]
    with c.cond:
        conds = c.workloads[(ns, workload["metadata"]["name"])]["status"]["conditions"]
        if was_active and not active:
            _set(conds, "Evicted", "True", "Deactivated", "The workload is deactivated")
            _set(conds, "QuotaReserved", "False", "Pending", "The workload is deactivated")
            _set(conds, "Admitted", "False", "NoReservation", "The workload has no reservation")
        elif active and not was_active:
            _set(conds, "Requeued", "True", "Reactivated", "The workload was reactivated")
            _set(conds, "Evicted", "False", "Reactivated", "The workload was reactivated")
            _set(conds, "QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cluster-queue")
            _set(conds, "Admitted", "True", "Admitted", "The workload is admitted")
        c.cond.notify_all()
    if was_active != active:
        c.set_suspend(ns, owner, not active)
        if not active:
            c.delete_pods(ns, owner)  # the operator's DeletePodsAndServices for a suspended job


class FaultHandler:
    """The handler side (a mixin of fake_kube._Handler); each returns False for a request not its own."""

    def _forbidden(self, message: str) -> bool:
        self._send(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                         "message": message, "code": 403})
        return True

    def fault_delete(self, group: str, parts: List[str]) -> bool:
        if group != "" or parts[1:2] != ["pods"] or len(parts) != 3:
            return False
        c, (ns, _, name) = self.cluster, parts
        with c.cond:
            c.requests.append(("", "pods", "delete"))
            c.cond.notify_all()  # a scripted job may wait for the attempt
        if ("", "pods", "delete") in c.denied:
            return self._forbidden(f'pods "{name}" is forbidden: User "system:serviceaccount:domino:domino-pipeline" '
                                   'cannot delete resource "pods" in API group "" in the namespace "' + ns + '"')
        with c.cond:
            pod = c.pods.pop((ns, name), None)
            c.cond.notify_all()
        if pod is None:
            self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                             "message": f'pods "{name}" not found', "code": 404})
            return True
        c.pod_deletes.append(name)
        threading.Thread(target=operator_recreates, args=(c, ns, pod), daemon=True).start()
        self._send(200, pod)  # a pod DELETE answers with the object (its deletionTimestamp set)
        return True

    def fault_patch(self) -> bool:
        if not self.path.startswith(WORKLOADS) or "/workloads/" not in self.path:
            return False
        c = self.cluster
        ns, _, name = self.path[len(WORKLOADS):].split("?")[0].split("/")
        c.requests.append(("kueue.x-k8s.io", "workloads", "patch"))
        if ("kueue.x-k8s.io", "workloads", "patch") in c.denied:
            return self._forbidden(f'workloads.kueue.x-k8s.io "{name}" is forbidden: User "system:serviceaccount:'
                                   'domino:domino-pipeline" cannot patch resource "workloads"')
        patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with c.cond:
            found = c.workloads.get((ns, name))
            if found is None:
                self._gone(f'workloads.kueue.x-k8s.io "{name}" not found')
                return True
            was_active = found["spec"].get("active", True)
            found["spec"].update(patch.get("spec") or {})  # merge patch of the flat spec fields sent
            answer = copy.deepcopy(found)
        threading.Thread(target=kueue_reacts, args=(c, ns, answer, was_active), daemon=True).start()
        self._send(200, answer)
        return True
