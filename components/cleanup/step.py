"""Logic of the exit handler: make sure no training job of this run outlives the pipeline run.

The pretrain step deletes its job when it ends normally. This step covers the rest: a cancelled run
(the launcher pod was killed mid-wait) or a launcher that crashed. It finds the run's PyTorchJobs by
their ``domino/run-id`` label and deletes every one that is not finished; a Failed job is kept for
debugging when ``keep_failed`` (the operator's TTL removes it later), a Succeeded one is deleted.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List


def _job_state(job: Dict[str, Any]) -> str:
    """The last true condition type of a PyTorchJob (Created, Running, Succeeded, Failed, ...), or ''."""
    state = ""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if str(condition.get("status")) == "True":
            state = condition.get("type", state)
    return state


def cleanup_jobs(
    run_id: str,
    namespace: str,
    pipeline_state: str,
    keep_failed: bool = True,
    api: Any = None,
    log: Callable[[str], None] = print,
) -> List[str]:
    """Deletes this run's leftover PyTorchJobs.

    Args:
        run_id: The pipeline run id (the jobs carry it as the ``domino/run-id`` label).
        namespace: Namespace of the jobs ('': this pod's, ``POD_NAMESPACE``, as the pretrain step chose).
        pipeline_state: Final state of the run's tasks (SUCCEEDED, FAILED, CANCELED, ...), for the log.
        keep_failed: Keep jobs whose last condition is Failed.
        api: A ``kubernetes.client.CustomObjectsApi`` (default: from the in-cluster config or kubeconfig).
        log: Receives one line per decision.

    Returns:
        Names of the deleted jobs.
    """
    from kubernetes.client.rest import ApiException

    from domino.launch.naming import RUN_ID_LABEL, label_value
    from domino.launch.render import GROUP, PLURAL, VERSION
    from domino.launch.spec import default_namespace

    namespace = namespace or default_namespace()

    if api is None:
        from kubernetes import client

        from domino.launch.kube_backend import load_api_client

        api = client.CustomObjectsApi(load_api_client())
    selector = f"{RUN_ID_LABEL}={label_value(run_id)}"
    jobs = api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, label_selector=selector)
    deleted = []
    for job in jobs.get("items", []):
        name = job["metadata"]["name"]
        state = _job_state(job)
        if state == "Failed" and keep_failed:
            log(f"cleanup: keeping failed job {name} for debugging (pipeline {pipeline_state})")
            continue
        try:
            api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                propagation_policy="Background")
        except ApiException as error:
            if error.status != 404:
                raise
            continue
        log(f"cleanup: deleted job {name} (state {state or 'unknown'}, pipeline {pipeline_state})")
        deleted.append(name)
    if not deleted:
        log(f"cleanup: no job of run {run_id} left to delete in {namespace}")
    return deleted
