"""One MLflow run written from a background thread, so the tracker can never stop or slow the caller.

Every call to the server (opening the run, each batch of metrics, artifacts, tags) is a task on one worker
thread. The caller only puts tasks on a bounded queue (dropping the oldest when the server falls behind) and
waits for the queue only in :meth:`TrackingSession.close`, at most ``close_timeout_s``. Each HTTP request is
bounded by MLflow's own settings, which domino gives tighter defaults than MLflow's (a timeout of 120 s and 7
retries with a backoff factor of 2 in mlflow 3.17.2, ``mlflow/environment_variables.py``, read per request by
``mlflow/utils/rest_utils.py:http_request``) unless the environment sets them. The first failure is said once
(one warning); what could not be logged is counted and said once more at the end; nothing is raised.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Callable, Dict, Optional

from domino.redact import redact_text, redact_uri

logger = logging.getLogger(__name__)

#: MLflow's own convention: tracking is on when this is set (``mlflow/environment_variables.py``).
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
#: The Kubernetes Secret that gives pipeline steps and training pods their MLflow credentials, when it exists:
#: each key, named as MLflow's variable (``mlflow/environment_variables.py``), becomes that variable.
CREDENTIAL_SECRET = "domino-mlflow"
CREDENTIAL_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
#: MLflow's HTTP settings and the bounded values domino uses unless the environment sets them: a request
#: waits at most 10 s and is retried twice after 1 s and 2 s (urllib3 ``Retry`` with connect, read and status
#: retries of MAX_RETRIES each, plus up to 1 s of jitter: ``mlflow/utils/request_utils.py``), and a server's
#: ``Retry-After`` (unbounded in urllib3) is not obeyed.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER": "false"}
#: MLflow's switch for the run links it prints to stdout (``mlflow/environment_variables.py``).
SUPPRESS_URL_PRINTING_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
#: Tasks waiting for the server before the oldest are dropped (one task is one log interval's metrics).
MAX_PENDING = 1000
#: How long :meth:`TrackingSession.close` waits for the queue to drain by default.
CLOSE_TIMEOUT_S = 15.0
_THREAD_NAME = "domino-mlflow"

#: A task: called on the worker thread with the MLflow client and the run id.
Task = Callable[[Any, str], None]
#: Opens (creates or resumes) the run on the worker thread; returns its run id.
Opener = Callable[[Any], str]


def tracking_uri() -> Optional[str]:
    """``$MLFLOW_TRACKING_URI``, or None when tracking is off."""
    return os.environ.get(TRACKING_URI_ENV) or None


def apply_http_defaults() -> Dict[str, str]:
    """Sets the bounded HTTP defaults where the environment has none; returns the settings in force."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in HTTP_DEFAULTS}


class _OwnThreadOnly(logging.Filter):
    """Drops records logged on the worker thread: urllib3 warns on every retry and MLflow on every failed
    request, and a server that is down must be said once, not once per request."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != _THREAD_NAME


_QUIET = _OwnThreadOnly()


def _quiet_library_loggers() -> None:
    for name in ("urllib3.connectionpool", "urllib3.util.retry", "mlflow"):
        target = logging.getLogger(name)
        if _QUIET not in target.filters:
            target.addFilter(_QUIET)
        for handler in target.handlers:  # mlflow's own handler receives its child loggers' records
            if _QUIET not in handler.filters:
                handler.addFilter(_QUIET)


class TrackingSession:
    """An MLflow run fed from a worker thread.

    Args:
        uri: The tracking URI.
        opener: Creates or resumes the run (on the worker thread); returns its run id.
        what: What the run is, for the one warning (e.g. "training run").
    """

    def __init__(self, uri: str, opener: Opener, what: str) -> None:
        self.uri, self.what = uri, what
        self.shown_uri = redact_uri(uri)  # what warnings name: logs are read by more people than the server's owners
        if self.shown_uri != uri:
            # MLflow prints "View run ... at: <the URI whole>" when a run ends (``_log_url`` in
            # mlflow/tracking/_tracking_service/client.py, mlflow 3.18.0) unless this is set; domino's own line
            # names the run.
            os.environ[SUPPRESS_URL_PRINTING_ENV] = "true"
        self.run_id: Optional[str] = None
        self.lost = 0  # tasks not logged (failed or dropped)
        self._warned = False
        self._queue: "queue.Queue[Optional[Task]]" = queue.Queue(maxsize=MAX_PENDING)
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(opener,), name=_THREAD_NAME, daemon=True)
        self._thread.start()

    def submit(self, task: Task) -> None:
        """Queues ``task``; never blocks (when the queue is full, the oldest task is dropped)."""
        while True:
            try:
                self._queue.put_nowait(task)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.lost += 1
                except queue.Empty:
                    pass

    def wait_opened(self, timeout_s: float) -> Optional[str]:
        """The run id once the run is open (None when opening failed or took longer than ``timeout_s``)."""
        self._opened.wait(timeout_s)
        return self.run_id

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Lets the queued tasks finish for at most ``timeout_s``; returns whether all of them were logged."""
        self.submit(None)  # type: ignore[arg-type]  # the worker's stop signal, after every queued task
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            pending = self._queue.qsize()
            self.lost += pending
            logger.warning("MLflow at %s: gave up waiting after %.0f s; %d updates of the %s not logged "
                           "(the metrics file has them all)", self.shown_uri, timeout_s, self.lost, self.what)
            return False
        if self.lost:
            logger.warning("MLflow at %s: %d updates of the %s were not logged (the metrics file has them all)",
                           self.shown_uri, self.lost, self.what)
        return self.lost == 0

    def _fail(self, doing: str, error: BaseException) -> None:
        self.lost += 1
        if not self._warned:
            self._warned = True
            text = redact_text(" ".join(str(error).split()))[:300]  # MLflow's errors quote the URI whole
            logger.warning("MLflow at %s unavailable while %s (%s: %s); training goes on, the metrics file "
                           "keeps every number", self.shown_uri, doing, type(error).__name__, text)

    def _work(self, opener: Opener) -> None:
        _quiet_library_loggers()
        client = None
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=self.uri)
            self.run_id = opener(client)
        except ImportError as error:
            self._fail("importing the client (pip install 'domino[tracking]')", error)
        except Exception as error:  # noqa: BLE001 - any failure of the tracker is reported, never raised
            self._fail(f"opening the {self.what}", error)
        finally:
            self._opened.set()
        while True:
            task = self._queue.get()
            if task is None:
                return
            if self.run_id is None:
                self.lost += 1
                continue
            try:
                task(client, self.run_id)
            except Exception as error:  # noqa: BLE001 - as above
                self._fail(f"logging to run {self.run_id}", error)
