"""Who owns a training job: the pod of the launcher that created or adopted it.

The job carries an ownerReference to the launching pod (downward API ``POD_NAME``/``POD_UID``), so that
deleting a pipeline run's pods deletes its job too. A retried launcher (the pipeline step run again in a
new pod) adopts the job it finds under its run's name and must take that ownership over: Kubernetes'
garbage collector deletes an object once none of its owners exists any more (``pkg/controller/
garbagecollector/garbagecollector.go``, ``attemptToDeleteItem``: an object with no "solid" owner left is
deleted), so a job still owned only by the first attempt's pod is deleted, mid-run, when that pod is
collected.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from domino.launch.job_api_base import JobApi


def owner_reference(namespace: str, log: Callable[[str], None]) -> Optional[Dict[str, Any]]:
    """An ownerReference to the launching pod (``POD_NAME``, ``POD_UID``), if in the job's namespace."""
    name, uid = os.environ.get("POD_NAME"), os.environ.get("POD_UID")
    if not (name and uid):
        return None
    pod_namespace = os.environ.get("POD_NAMESPACE")
    if pod_namespace and pod_namespace != namespace:
        log(f"not setting an owner reference: launcher pod is in namespace {pod_namespace}, job in {namespace}")
        return None
    # blockOwnerDeletion needs delete rights on the owner's finalizers; garbage collection works without it.
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "controller": False,
            "blockOwnerDeletion": False}


def adopt_owner(custom, api: JobApi, job: Dict[str, Any], owner: Dict[str, Any], log: Callable[[str], None],
                timeout_s: float, attempts: int = 5) -> Dict[str, Any]:
    """Makes ``owner`` (this launcher's pod) the adopted job's owner in place of an earlier attempt's pod.

    Custom resources take JSON merge patches (RFC 7386; for them the API server serves json-patch,
    merge-patch and apply only, ``apiextensions-apiserver/pkg/apiserver/customresource_handler.go``, and
    the ``kubernetes`` client's ``patch_namespaced_custom_object`` sends ``application/merge-patch+json``).
    In a merge patch a list replaces the old one whole, so the patch carries the job's owners without any
    Pod, plus ``owner``, and the ``resourceVersion`` it read: if the job changed meanwhile (the operator
    updates its status all the time) the API server answers 409 Conflict and the job is read again. A
    refusal (the launcher's Role lacks ``patch``) is reported and the job followed anyway.

    Args:
        custom: A ``kubernetes.client.CustomObjectsApi``.
        api: The job's API (group, version, plural, kind).
        job: The adopted job as read.
        owner: The ownerReference of this launcher's pod.
        log: Receives what was done.
        timeout_s: Timeout of each request.
        attempts: Conflicts tolerated before giving up.

    Returns:
        The job as the API server last returned it.
    """
    from kubernetes.client.rest import ApiException

    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    for _ in range(attempts):
        current = job["metadata"].get("ownerReferences") or []
        if [ref.get("uid") for ref in current if ref.get("kind") == "Pod"] == [owner["uid"]]:
            return job
        others = [ref for ref in current if not (ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1")]
        patch = {"metadata": {"ownerReferences": others + [owner],
                              "resourceVersion": job["metadata"].get("resourceVersion")}}
        try:
            job = custom.patch_namespaced_custom_object(api.group, api.version, ns, api.plural, name, patch,
                                                        _request_timeout=timeout_s)
            log(f"{api.kind} {ns}/{name} is now owned by this pod, {owner['name']}")
            return job
        except ApiException as error:
            if error.status != 409:
                log(f"warning: could not make pod {owner['name']} the owner of {api.kind} {ns}/{name} "
                    f"({error.status} {error.reason}); the job is deleted when its earlier owner pod is: grant "
                    "the launcher 'patch' on it (k8s/base/launcher-rbac.yaml)")
                return job
        job = custom.get_namespaced_custom_object(api.group, api.version, ns, api.plural, name,
                                                  _request_timeout=timeout_s)
    log(f"warning: {api.kind} {ns}/{name} kept changing; its owner is still an earlier attempt's pod")
    return job
