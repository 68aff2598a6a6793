"""Logic of the exit handler: make sure no training job of this run outlives the pipeline run.

The pretrain step deletes its job when it ends normally. This step covers the rest: a cancelled run
(the launcher pod was killed mid-wait) or a launcher that crashed. It finds the run's jobs (of the run's
job API) by their ``domino/run-id`` label and deletes every one that is not finished; a Failed job is
kept for debugging when ``keep_failed`` (the controller's TTL removes it later), a Succeeded one is deleted.
"""

from __future__ import annotations

from typing import Any, Callable, List

from domino.launch.job_api import DEFAULT_JOB_API


def cleanup_jobs(
    run_id: str,
    namespace: str,
    pipeline_state: str,
    keep_failed: bool = True,
    api: Any = None,
    log: Callable[[str], None] = print,
    job_api: str = DEFAULT_JOB_API,
) -> List[str]:
    """Deletes this run's leftover training jobs.

    Args:
        run_id: The pipeline run id (the jobs carry it as the ``domino/run-id`` label).
        namespace: Namespace of the jobs ('': this pod's, ``POD_NAMESPACE``, as the pretrain step chose).
        pipeline_state: Final state of the run's tasks (SUCCEEDED, FAILED, CANCELED, ...), for the log.
        keep_failed: Keep jobs whose last condition is Failed.
        api: A ``kubernetes.client.CustomObjectsApi`` (default: from the in-cluster config or kubeconfig).
        log: Receives one line per decision.
        job_api: The jobs' API (``pytorchjob`` or ``trainjob``, see :mod:`domino.launch.job_api`).

    Returns:
        Names of the deleted jobs.
    """
    from kubernetes.client.rest import ApiException

    from domino.launch.job_api import job_api as find_job_api
    from domino.launch.naming import RUN_ID_LABEL, label_value
    from domino.launch.spec import default_namespace

    namespace = namespace or default_namespace()
    kind = find_job_api(job_api)
    resource = (kind.group, kind.version, namespace, kind.plural)

    if api is None:
        from kubernetes import client

        from domino.launch.kube_backend import load_api_client

        api = client.CustomObjectsApi(load_api_client())
    selector = f"{RUN_ID_LABEL}={label_value(run_id)}"
    jobs = api.list_namespaced_custom_object(*resource, label_selector=selector)
    deleted = []
    for job in jobs.get("items", []):
        name = job["metadata"]["name"]
        state = kind.state(job).phase or ""
        if state == "Failed" and keep_failed:
            log(f"cleanup: keeping failed job {name} for debugging (pipeline {pipeline_state})")
            continue
        try:
            api.delete_namespaced_custom_object(*resource, name, propagation_policy="Background")
        except ApiException as error:
            if error.status != 404:
                raise
            continue
        log(f"cleanup: deleted job {name} (state {state or 'unknown'}, pipeline {pipeline_state})")
        deleted.append(name)
    if not deleted:
        log(f"cleanup: no job of run {run_id} left to delete in {namespace}")
    return deleted
