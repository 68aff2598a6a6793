"""The MLflow run of ``domino pretrain`` and ``domino evaluate``: what is logged, when, and to which run.

Global rank 0 of a training run opens (or, on resume, continues) the run on the tracking session's worker
thread, logs the resolved config as parameters once, when the run is created, and at every log interval the
metrics the interval has already read from the device (the caller hands over plain numbers: nothing here
reads a tensor). At the end it attaches the metrics file (small) and records the checkpoint by reference (a
tag naming its folder: the artifact store is not meant for checkpoint-sized files).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

from domino.redact import redact_text, redact_uri
from domino.tracking.runs import (DEFAULT_EXPERIMENT, KFP_RUN_ID_ENV, KFP_RUN_TAG, RunPointer, flat_params, now_ms,
                                  read_pointer, write_pointer)
from domino.tracking.session import CLOSE_TIMEOUT_S, TrackingSession, apply_http_defaults, tracking_uri

logger = logging.getLogger(__name__)

#: ``(name, value, step)``: one metric point.
Scalar = Tuple[str, float, int]
#: Tag naming the checkpoint save root of a training run (the checkpoint by reference).
CHECKPOINT_TAG = "domino.checkpoint_dir"


class RunTracker:
    """Feeds one MLflow run; every method returns at once (the work happens on the session's thread)."""

    def __init__(self, session: TrackingSession) -> None:
        self.session = session

    def log_metrics(self, scalars: Iterable[Scalar]) -> None:
        """Logs metric points (names as given, e.g. Megatron's ``lm loss``) at their steps."""
        points = [(str(name), float(value), int(step)) for name, value, step in scalars]
        if points:
            stamp = now_ms()
            self.session.submit(lambda client, run_id: client.log_batch(run_id, metrics=_metrics(points, stamp)))

    def set_tags(self, tags: Dict[str, Any]) -> None:
        """Sets run tags (values as text)."""
        if tags:
            self.session.submit(lambda client, run_id: client.log_batch(run_id, tags=_tags(tags)))

    def log_artifact(self, path: Optional[str], folder: Optional[str] = None) -> None:
        """Uploads the file at ``path`` (read when the upload runs) when it exists."""
        if path and os.path.isfile(path):
            self.session.submit(lambda client, run_id: client.log_artifact(run_id, path, folder))

    def finish(self, completed: bool, timeout_s: float = CLOSE_TIMEOUT_S) -> Optional[str]:
        """Marks a completed run FINISHED (an interrupted one stays RUNNING for its resume), then waits at most
        ``timeout_s`` for what is queued; returns the run id (None when the run could not be opened)."""
        if completed:
            self.session.submit(lambda client, run_id: client.set_terminated(run_id, "FINISHED"))
        self.session.close(timeout_s)
        return self.session.run_id


def evaluation_scalars(result: Dict[str, Any], step: int) -> List[Scalar]:
    """The metric points of a standalone evaluation (``domino evaluate``, the pipeline's gate) at the checkpoint's
    iteration: ``evaluate lm loss``, ``evaluate lm loss ppl``, ``evaluate token accuracy`` from the result's
    ``loss``, ``ppl`` and ``accuracy``, and ``evaluate <name>`` for any other number given (apart from training's
    own ``lm loss test``, measured on its own batches)."""
    names = {"loss": "evaluate lm loss", "ppl": "evaluate lm loss ppl", "accuracy": "evaluate token accuracy"}
    return [(names.get(key, f"evaluate {key.replace('_', ' ')}"), float(value), step) for key, value in result.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)]


def _metrics(points: List[Scalar], stamp: int):
    from mlflow.entities import Metric

    return [Metric(name, value, stamp, step) for name, value, step in points]


def _tags(tags: Dict[str, Any]):
    from mlflow.entities import RunTag

    return [RunTag(str(k), redact_text(str(v))) for k, v in tags.items()]


def start_training_run(config_dict: Dict[str, Any], save_root: Optional[str], experiment_name: Optional[str],
                       run_name: Optional[str], resumed_iteration: int,
                       extra_params: Optional[Dict[str, Any]] = None) -> Optional[RunTracker]:
    """The tracker of a training run, or None when ``MLFLOW_TRACKING_URI`` is unset (call it on rank 0 only).

    Args:
        config_dict: The resolved config (``config_to_dict``), logged as parameters when the run is created.
        save_root: ``--save``: where the run pointer is kept, so a resumed run continues its MLflow run.
        experiment_name: ``--mlflow-experiment-name`` (default ``$MLFLOW_EXPERIMENT_NAME``, else ``domino``).
        run_name: ``--mlflow-run-name`` (default the KFP run id when the pipeline started the run).
        resumed_iteration: The iteration training starts at (0: a fresh start).
        extra_params: Derived settings logged with the config (world size, padded vocabulary, ...).
    """
    uri = tracking_uri()
    if uri is None:
        return None
    apply_http_defaults()
    opener = functools.partial(_open_training_run, uri=uri, params=flat_params(config_dict, extra_params),
                               save_root=save_root, experiment_name=experiment_name, run_name=run_name,
                               resumed_iteration=resumed_iteration)
    return RunTracker(TrackingSession(uri, opener, "training run"))


def _experiment_id(client, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # noqa: BLE001 - created by another run meanwhile: read it back
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def _open_training_run(client, uri: str, params: Dict[str, str], save_root: Optional[str],
                       experiment_name: Optional[str], run_name: Optional[str], resumed_iteration: int) -> str:
    """Continues the run named by ``save_root``'s pointer, else creates one and logs its parameters."""
    from mlflow.entities import Param

    pointer = read_pointer(save_root, uri) if save_root else None
    run = _existing_run(client, pointer.run_id) if pointer is not None else None
    if run is not None and run.info.lifecycle_stage == "active":  # else deleted: a resume starts a new run
        client.update_run(run.info.run_id, status="RUNNING")
        client.set_tag(run.info.run_id, "domino.resumed_at_iteration", str(resumed_iteration))
        logger.info("MLflow: continuing run %s at iteration %d (%s)", run.info.run_id, resumed_iteration,
                    redact_uri(uri))
        return run.info.run_id
    kfp_run = os.environ.get(KFP_RUN_ID_ENV)
    name = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    experiment_id = _experiment_id(client, name)
    tags = {KFP_RUN_TAG: kfp_run, CHECKPOINT_TAG: save_root and os.path.abspath(save_root)}
    run = client.create_run(experiment_id, run_name=run_name or kfp_run or None,
                            tags={key: value for key, value in tags.items() if value})
    run_id = run.info.run_id
    client.log_batch(run_id, params=[Param(key, value) for key, value in sorted(params.items())])
    if save_root:
        write_pointer(save_root, RunPointer(uri, experiment_id, run_id))
    logger.info("MLflow: run %s in experiment '%s' (%s)", run_id, name, redact_uri(uri))
    return run_id


def _existing_run(client, run_id: str):
    """The run, or None when the server no longer has it (deleted for good: a resume then starts a new run)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def tracker_of_checkpoint(load: str, what: str, uri: Optional[str] = None) -> Optional[RunTracker]:
    """A tracker of the MLflow run that trained the checkpoint at ``load`` (its save root's pointer); None when
    tracking is off (``uri``, default ``$MLFLOW_TRACKING_URI``, empty) or the checkpoint has no run on this
    server (said in one line)."""
    uri = uri or tracking_uri()
    if not uri:
        return None
    pointer = read_pointer(load, uri)
    if pointer is None:
        logger.info("MLflow: %s has no run on %s (trained without tracking): not logging the %s", load,
                    redact_uri(uri), what)
        return None
    apply_http_defaults()
    return RunTracker(TrackingSession(uri, lambda client: pointer.run_id, what))
