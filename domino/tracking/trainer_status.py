"""Progress in the TrainJob: rank 0 posts ``status.trainerStatus`` to Kubeflow Trainer's status server.

Kubeflow Trainer v2.3 keeps a trainer's progress in ``TrainJob.status.trainerStatus`` (alpha, feature gate
``TrainJobStatus``, KEP-2779). What this module relies on, read from kubeflow/trainer v2.3.0:

- ``pkg/runtime/framework/plugins/trainjobstatus/trainjobstatus.go``: with the gate on, every trainer container
  gets ``KUBEFLOW_TRAINER_SERVER_URL`` (``https://<webhook service>.<ns>.svc:<port>`` + the status path),
  ``KUBEFLOW_TRAINER_SERVER_CA_CERT`` and ``KUBEFLOW_TRAINER_SERVER_TOKEN``: the last two are *file paths*
  (``/var/run/secrets/kubeflow/trainer/ca.crt`` and ``.../token``) in a projected volume; the token is a service
  account token with the audience ``trainer.kubeflow.org/v1alpha1/namespaces/<ns>/trainjobs/<name>/status`` and
  ``expirationSeconds: 3600``, which the kubelet rewrites once 80 % of its lifetime has passed
  (``requiresRefresh`` in kubernetes ``pkg/kubelet/token/token_manager.go``). So both files are read again for
  every request.
- ``pkg/statusserver/server.go``, ``auth.go``, ``middleware.go``: ``POST <path>`` with a JSON
  ``{"trainerStatus": {...}}`` body of at most 64 KiB (413 above), ``Authorization: Bearer <token>`` (the token's
  signature, expiry, audience and ``kubernetes.io`` namespace are checked; any failure is 403, not 401); a body
  that does not decode is 422 "Invalid payload", a status the API server rejects is 422 with its message, a
  missing TrainJob 404, anything else 500; every error is a ``metav1.Status`` JSON object; 200 echoes the body.
- ``pkg/apis/trainer/v1alpha1/trainjob_types.go`` (``TrainerStatus``, ``Metric``): ``progressPercentage`` an
  int32 in 0-100, ``estimatedRemainingSeconds`` an int32 >= 0 (a JSON number with a fraction does not decode
  into them), at most 256 ``metrics`` of ``{"name", "value"}`` strings of 1-64 characters, and
  ``lastUpdatedTime`` (RFC 3339) required by a CEL rule.
- ``docs/user-guides/trainjob-progress.md``: clients throttle to at most one request every 5 seconds (the
  status server's own API client is limited to 5 requests/s for all TrainJobs together,
  ``manifests/base/manager/controller_manager_config.yaml``) and must never let reporting break training.

The ``kubeflow`` SDK 0.5.0 has a helper for this (``update_trainjob_status`` in
``kubeflow/trainer/backends/kubernetes/utils.py``), not used here: it is not in the training image (a test
dependency only), it keeps the token for 300 s instead of reading the rotated file, its throttle is a module
global that drops calls, and it warns on every failed request. The request below is the same as its one.

:class:`TrainerStatusPoster` posts from one daemon thread fed through a one-slot mailbox: the training thread
only replaces the unsent figures with the newest (no I/O, never blocks on the network); the thread posts at
most every :data:`INTERVAL_S`, backs off while the server fails, says the first failure in one warning and
later ones at most every :data:`REPEAT_WARNING_S`. Nothing here raises into training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Mapping, Optional

logger = logging.getLogger(__name__)

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_CERT_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
#: At most one request per this many seconds (the Trainer's user guide; the SDK's ``_MIN_UPDATE_INTERVAL_SECONDS``).
INTERVAL_S = 5.0
#: While the server fails, the pause doubles up to this.
MAX_BACKOFF_S = 60.0
#: One request's bound (connect and read); the server itself times out reads after 10 s (``server.go``).
TIMEOUT_S = 5.0
#: How long the end of a finished run waits for its last figures (100 %): the pacing and a quick answer, not
#: the back-off of a failing server.
CLOSE_WAIT_S = INTERVAL_S + 1.0
#: A server that keeps failing is said again at most this often.
REPEAT_WARNING_S = 600.0
INT32_MAX = 2**31 - 1
#: ``Metric.name`` and ``Metric.value``: 1-64 characters (``trainjob_types.go``).
METRIC_TEXT_MAX = 64
_THREAD_NAME = "domino-trainjob-status"


@dataclass(frozen=True)
class Endpoint:
    """Where and how to post: the status URL and the paths of the CA certificate and the token files."""

    url: str
    ca_cert: Optional[str]
    token: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Optional["Endpoint"]:
        """The endpoint the Trainer injected, or None outside a TrainJob (or with the feature gate off)."""
        url, token = env.get(URL_ENV), env.get(TOKEN_ENV)
        if not url or not token:
            return None
        return cls(url, env.get(CA_CERT_ENV) or None, token)


def _metric_value(value: float) -> str:
    return format(value, ".6g")  # at most 12 characters: inside the 64 allowed


def trainer_status(record: Mapping[str, Any], train_iters: int, observed: datetime) -> Dict[str, Any]:
    """The ``trainerStatus`` of a training record (``MetricsWriter.write``'s), valid for the Trainer's schema.

    Args:
        record: The log interval's record: ``iteration``, ``eta_s``, ``lm_loss``, ``tokens_per_s`` and, when the
            run has a goodput ledger, ``goodput``.
        train_iters: The run's last iteration (progress is ``iteration / train_iters``, rounded down).
        observed: When the figures were measured (``lastUpdatedTime``).
    """
    iteration = int(record["iteration"])
    status: Dict[str, Any] = {
        "progressPercentage": max(0, min(100, 100 * iteration // max(train_iters, 1))),
        "lastUpdatedTime": observed.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    eta = record.get("eta_s")
    if isinstance(eta, (int, float)) and math.isfinite(eta):
        status["estimatedRemainingSeconds"] = max(0, min(INT32_MAX, int(round(eta))))
    metrics: List[Dict[str, str]] = [{"name": "iteration", "value": f"{iteration}/{train_iters}"}]
    for name, key in (("loss", "lm_loss"), ("tokens_per_s", "tokens_per_s"), ("goodput", "goodput")):
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            metrics.append({"name": name, "value": _metric_value(value)})
    status["metrics"] = metrics
    return status


class StatusRejected(Exception):
    """The server answered with an error status (its ``metav1.Status`` message in the text)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code = code


def post(endpoint: Endpoint, status: Dict[str, Any], timeout_s: float = TIMEOUT_S) -> None:
    """POSTs one ``trainerStatus``; the token and CA files are read now (they rotate).

    Raises:
        StatusRejected: an HTTP error status.
        OSError: the files, the connection or TLS failed (``urllib.error.URLError`` is one).
    """
    import ssl
    import urllib.error
    import urllib.request

    with open(endpoint.token) as f:
        token = f.read().strip()
    context = ssl.create_default_context(cafile=endpoint.ca_cert)
    # The status server is a cluster Service: no proxy from the environment applies.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    request = urllib.request.Request(endpoint.url, data=json.dumps({"trainerStatus": status}).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {token}",
                                                             "Content-Type": "application/json"})
    try:
        with opener.open(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as error:
        with error:
            body = error.read(4096).decode(errors="replace")
        try:
            message = json.loads(body).get("message") or body
        except (ValueError, AttributeError):
            message = body
        raise StatusRejected(error.code, " ".join(str(message).split())[:300]) from None


class TrainerStatusPoster:
    """Posts a run's progress to its TrainJob from a daemon thread; the caller never waits on the network.

    Args:
        endpoint: Where to post (:meth:`Endpoint.from_env`).
        train_iters: The run's last iteration.
        interval_s: The least time between two requests.
        send: Posts one status (:func:`post`); a test may pass another.
        clock: Monotonic seconds.
    """

    def __init__(self, endpoint: Endpoint, train_iters: int, interval_s: float = INTERVAL_S,
                 send: Optional[Callable[[Endpoint, Dict[str, Any]], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint, self.train_iters, self.interval_s = endpoint, train_iters, interval_s
        self._send, self._clock = send or post, clock
        self._cond = threading.Condition()
        self._pending: Optional[Dict[str, Any]] = None  # the one slot: the newest figures not yet posted
        self._next_at = 0.0  # no request before this (monotonic)
        self._closing: Optional[float] = None  # when closing: the deadline of the last post
        self._thread: Optional[threading.Thread] = None
        self.posted = self.failed = 0
        self._failing_since_warning = 0
        self._warned_at: Optional[float] = None

    @classmethod
    def from_env(cls, train_iters: int) -> Optional["TrainerStatusPoster"]:
        endpoint = Endpoint.from_env()
        if endpoint is None:
            return None
        logger.info("posting progress to the TrainJob's status at %s (at most every %.0f s)", endpoint.url,
                    INTERVAL_S)
        return cls(endpoint, train_iters)

    def offer(self, record: Mapping[str, Any]) -> None:
        """Puts the record's figures in the slot (replacing unsent ones); never blocks on the network."""
        status = trainer_status(record, self.train_iters, datetime.now(timezone.utc))
        with self._cond:
            if self._closing is not None:
                return
            self._pending = status
            if self._thread is None:  # started at the first figures, after the data loader's workers exist
                self._thread = threading.Thread(target=self._work, name=_THREAD_NAME, daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self, completed: bool = True, wait_s: float = CLOSE_WAIT_S) -> None:
        """Ends the thread. A completed run's last figures are posted when the pacing allows it within
        ``wait_s``; an interrupted run (SIGTERM) does not wait. A request still hanging is left to the
        daemon thread."""
        with self._cond:
            if not completed:
                self._pending = None
            self._closing = self._clock() + (wait_s if completed else 0.0)
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(wait_s if completed else 0.0)
        if self.failed:
            logger.warning("TrainJob status at %s: %d of %d posts failed in this run", self.endpoint.url,
                           self.failed, self.failed + self.posted)

    def _take(self) -> Optional[Dict[str, Any]]:
        """Waits for figures and the pacing; None when closing leaves nothing to post."""
        with self._cond:
            while True:
                now = self._clock()
                if self._closing is not None and (self._pending is None or self._next_at > self._closing):
                    return None
                if self._pending is not None and now >= self._next_at:
                    status, self._pending = self._pending, None
                    return status
                timeout = None if self._pending is None else self._next_at - now
                self._cond.wait(timeout)

    def _work(self) -> None:
        failures = 0  # in a row
        while True:
            status = self._take()
            if status is None:
                return
            try:
                self._send(self.endpoint, status)
            except Exception as error:  # noqa: BLE001 - reporting never raises into training
                failures += 1
                self._failed(error)
                retry = not (isinstance(error, StatusRejected) and 400 <= error.code < 500)
                with self._cond:
                    if retry and self._pending is None and self._closing is None:
                        self._pending = status  # the same figures again, unless newer ones came
                    self._next_at = self._clock() + min(MAX_BACKOFF_S, self.interval_s * 2 ** failures)
                continue
            if failures:
                logger.info("TrainJob status at %s: posted again after %d failed attempts", self.endpoint.url,
                            failures)
            failures = 0
            self.posted += 1
            with self._cond:
                self._next_at = self._clock() + self.interval_s

    def _failed(self, error: Exception) -> None:
        self.failed += 1
        self._failing_since_warning += 1
        now = self._clock()
        if self._warned_at is not None and now - self._warned_at < REPEAT_WARNING_S:
            return
        text = " ".join(str(error).split())[:300]
        if self._warned_at is None:
            logger.warning("TrainJob status at %s: not posted (%s: %s); training goes on, this is said again "
                           "at most every %.0f min", self.endpoint.url, type(error).__name__, text,
                           REPEAT_WARNING_S / 60)
        else:
            logger.warning("TrainJob status at %s: %d more posts failed (last: %s: %s)", self.endpoint.url,
                           self._failing_since_warning, type(error).__name__, text)
        self._warned_at, self._failing_since_warning = now, 0
