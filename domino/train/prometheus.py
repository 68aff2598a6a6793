"""Rank 0's Prometheus endpoint (``--metrics-port``): the logging interval's numbers for a platform's scraper.

Off by default. With ``--metrics-port N`` global rank 0 serves ``http://<pod>:N/metrics`` in the Prometheus
text format through ``prometheus_client`` (the ``metrics`` extra; its own HTTP server on a daemon thread,
``start_http_server``), and every logging interval sets the gauges from the numbers the interval has
already read from the device (plain floats: nothing here reads a tensor or blocks the step):

=================================  ==========================================================
``domino_tokens_per_second``       training throughput of the whole job
``domino_train_loss``              mean LM loss of the interval
``domino_iteration_seconds``       time of one iteration
``domino_mfu``                     model FLOPs utilisation, 0-1 (absent without a known peak)
``domino_iteration``               the iteration last logged
``domino_consumed_samples``        samples consumed so far
``domino_goodput``                 the share of the run's wall time so far that trained, over every
                                   attempt, 0-1 (with ``--save``: :mod:`domino.goodput`)
``domino_straggler_slowest_ratio`` with ``--log-straggler``: the slowest rank's compute time per step over
                                   the median's (a rank above 1.1 is named in the log)
``domino_goodput_seconds{part}``   that wall time (``part="wall"``) and its parts: productive,
                                   startup, checkpoint, evaluation, lost, idle, other
=================================  ==========================================================

The rendered pod declares the port (container port ``metrics``; ``domino.launch.render``), which is what
a PodMonitor or the NetworkPolicy rule of ``k8s/metrics`` names.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

#: (metric, help text, the record field it shows).
GAUGES = (
    ("domino_tokens_per_second", "Training throughput of the whole job, tokens/s.", "tokens_per_s"),
    ("domino_train_loss", "Mean LM loss of the last logging interval.", "lm_loss"),
    ("domino_iteration_seconds", "Time of one iteration in the last logging interval, seconds.", "iteration_time_s"),
    ("domino_mfu", "Model FLOPs utilisation of the last logging interval, 0-1.", "mfu"),
    ("domino_iteration", "The iteration last logged.", "iteration"),
    ("domino_consumed_samples", "Samples consumed so far.", "consumed_samples"),
    ("domino_goodput", "Share of the run's wall time so far that trained, over every attempt, 0-1.", "goodput"),
    ("domino_straggler_slowest_ratio", "The slowest rank's compute time per step over the median (--log-straggler).",
     "straggler_slowest_ratio"),
)


class PrometheusExporter:
    """Serves the gauges of :data:`GAUGES` on ``port`` (all interfaces) until :meth:`close`.

    Raises:
        RuntimeError: ``prometheus_client`` is not installed (``pip install 'domino[metrics]'``).
        OSError: the port cannot be bound.
    """

    def __init__(self, port: int, addr: str = "0.0.0.0") -> None:
        try:
            from prometheus_client import CollectorRegistry, Gauge, start_http_server
        except ImportError as error:
            raise RuntimeError("--metrics-port needs prometheus_client: pip install 'domino[metrics]'") from error
        self._gauge = Gauge
        self.registry = CollectorRegistry()  # our gauges only (no process/platform collectors)
        self.gauges: Dict[str, Any] = {}  # created with their first value: an unknown number is absent, not 0
        self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_port

    def update(self, record: Dict[str, Any]) -> None:
        """Sets every gauge whose field the logging record carries (a None, e.g. MFU on CPU, is skipped)."""
        for name, text, field in GAUGES:
            value: Optional[float] = record.get(field)
            if isinstance(value, (int, float)):
                if field not in self.gauges:
                    self.gauges[field] = self._gauge(name, text, registry=self.registry)
                self.gauges[field].set(float(value))
        parts = record.get("goodput_s")
        if isinstance(parts, dict):
            if "goodput_s" not in self.gauges:
                self.gauges["goodput_s"] = self._gauge(
                    "domino_goodput_seconds", "The run's wall time so far (part=wall) and its parts, seconds.",
                    labelnames=["part"], registry=self.registry)
            for name, seconds in parts.items():
                self.gauges["goodput_s"].labels(part=name.removesuffix("_s")).set(float(seconds))

    def close(self) -> None:
        """Stops serving (the port is free again)."""
        self.server.shutdown()
        self.server.server_close()
