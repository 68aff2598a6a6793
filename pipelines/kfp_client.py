"""Submitting and scheduling the pipeline on a Kubeflow Pipelines server (through ``kfp.Client``).

The pipeline is compiled fresh for every call (or taken from a given package file) and sent inline with
the run, so what runs is exactly this checkout's pipeline. Schedules are recurring runs with
``max_concurrency=1`` (two trainings never race on the promotion registry) and ``no_catchup=True``
(a paused schedule does not fire a burst of missed runs when re-enabled).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

from pipelines.cron import validate_cron
from pipelines.gpt_pretrain import PIPELINE_NAME, compile_pipeline


@dataclass
class Submitted:
    """Identifiers of what the server created."""

    id: str
    experiment_id: str
    name: str


#: Environment variable holding the KFP API bearer token (a flag would show it in `ps` and shell history).
TOKEN_ENV = "KFP_TOKEN"
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def token_from(host: str, token_file: Optional[str] = None) -> Optional[str]:
    """The API bearer token: the file's content, else ``$KFP_TOKEN``, else None.

    Raises:
        ValueError: the file cannot be read, or a token would go over plain http to a non-local host.
    """
    from urllib.parse import urlparse

    token = None
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as error:
            raise ValueError(f"--token-file {token_file}: cannot read it ({error.strerror})") from None
    token = token or os.environ.get(TOKEN_ENV) or None
    url = urlparse(host if "://" in host else "http://" + host)
    if token and url.scheme != "https" and url.hostname not in _LOCAL_HOSTS:
        raise ValueError(f"--host {host}: refusing to send the API token over plain http to a non-local host; "
                         "use https (or a port-forward to localhost)")
    return token


def make_client(host: str, namespace: Optional[str] = None, existing_token: Optional[str] = None):
    """A ``kfp.Client`` for ``host`` (the KFP API endpoint, e.g. http://localhost:8080)."""
    import kfp

    if not host:
        raise ValueError("--host: give the Kubeflow Pipelines API endpoint, e.g. http://localhost:8080")
    kwargs: Dict[str, Any] = {"host": host.rstrip("/")}
    if namespace:
        kwargs["namespace"] = namespace
    if existing_token:
        kwargs["existing_token"] = existing_token
    return kfp.Client(**kwargs)


@contextmanager
def pipeline_package(package: Optional[str] = None) -> Iterator[str]:
    """Yields ``package`` if given (it must exist), else a freshly compiled pipeline in a temporary file."""
    if package:
        if not os.path.isfile(package):
            raise ValueError(f"--package {package}: no such file")
        yield package
        return
    with tempfile.TemporaryDirectory(prefix="domino-pipeline-") as folder:
        yield compile_pipeline(os.path.join(folder, f"{PIPELINE_NAME}.yaml"))


def _with_job_namespace(params: Dict[str, Any], namespace: Optional[str]) -> Dict[str, Any]:
    """In a multi-user deployment the training job belongs in the run's namespace unless told otherwise."""
    if namespace and "namespace" not in params:
        return {**params, "namespace": namespace}
    return dict(params)


def submit(
    client: Any, params: Dict[str, Any], *, namespace: Optional[str] = None, experiment: str = "domino",
    run_name: Optional[str] = None, package: Optional[str] = None, service_account: Optional[str] = None,
) -> Submitted:
    """Starts one run of the pipeline.

    Args:
        client: A ``kfp.Client`` (see :func:`make_client`).
        params: Pipeline parameters (already parsed and checked).
        namespace: Kubeflow profile namespace (multi-user); also the training job's namespace unless
            ``params`` sets ``namespace``.
        experiment: Experiment to file the run under (created when missing).
        run_name: Display name (default: ``gpt-pretrain <timestamp>``).
        package: A compiled pipeline file to submit instead of compiling this checkout's pipeline.
        service_account: Kubernetes service account of the run's pods (needs rights on PyTorchJobs).
    """
    with pipeline_package(package) as path:
        result = client.create_run_from_pipeline_package(
            path, arguments=_with_job_namespace(params, namespace), run_name=run_name,
            experiment_name=experiment, namespace=namespace, service_account=service_account,
        )
    info = result.run_info
    return Submitted(id=result.run_id, experiment_id=getattr(info, "experiment_id", "") or "",
                     name=getattr(info, "display_name", "") or "")


def schedule(
    client: Any, cron: str, params: Dict[str, Any], *, name: str = f"{PIPELINE_NAME}-schedule",
    namespace: Optional[str] = None, experiment: str = "domino", package: Optional[str] = None,
    service_account: Optional[str] = None, enabled: bool = True,
) -> Submitted:
    """Creates a recurring run of the pipeline (``max_concurrency=1``, ``no_catchup=True``).

    Args:
        client: A ``kfp.Client``.
        cron: 6-field cron expression, seconds first (validated before anything is sent).
        params: Pipeline parameters; set ``warm_start=true`` for continual retraining.
        name: Display name of the recurring run.
        namespace, experiment, package, service_account: as for :func:`submit`.
        enabled: Create it enabled.

    Raises:
        CronError: a cron expression KFP would reject.
    """
    cron = validate_cron(cron)
    experiment_id = client.create_experiment(name=experiment, namespace=namespace).experiment_id
    with pipeline_package(package) as path:
        recurring = client.create_recurring_run(
            experiment_id=experiment_id, job_name=name, cron_expression=cron, max_concurrency=1, no_catchup=True,
            params=_with_job_namespace(params, namespace), pipeline_package_path=path, enabled=enabled,
            service_account=service_account,
        )
    return Submitted(id=recurring.recurring_run_id, experiment_id=experiment_id, name=name)


def list_schedules(client: Any, namespace: Optional[str] = None, experiment: Optional[str] = None) -> List[Dict[str, Any]]:
    """Recurring runs (of an experiment, or of the namespace) as rows: id, name, cron, status, concurrency."""
    experiment_id = None
    if experiment:
        experiment_id = client.get_experiment(experiment_name=experiment, namespace=namespace).experiment_id
    rows: List[Dict[str, Any]] = []
    token = ""
    while True:
        page = client.list_recurring_runs(page_token=token, page_size=100, experiment_id=experiment_id,
                                          namespace=namespace if experiment_id is None else None)
        for run in page.recurring_runs or []:
            trigger = run.trigger
            cron = trigger.cron_schedule.cron if trigger and trigger.cron_schedule else None
            interval = (trigger.periodic_schedule.interval_second
                        if trigger and trigger.periodic_schedule else None)
            rows.append({
                "id": run.recurring_run_id, "name": run.display_name,
                "schedule": cron or (f"every {interval}s" if interval else "-"),
                "status": run.status or run.mode or "-", "max_concurrency": run.max_concurrency,
                "no_catchup": run.no_catchup,
            })
        token = page.next_page_token or ""
        if not token:
            return rows


def delete_schedule(client: Any, schedule_id: str) -> None:
    """Deletes the recurring run ``schedule_id`` (its past runs stay)."""
    if not schedule_id:
        raise ValueError("schedule id: empty")
    client.delete_recurring_run(schedule_id)
