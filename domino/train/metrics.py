"""Where training numbers go: one log line per interval, a JSONL metrics file, TensorBoard events, MLflow.

TensorBoard tags are Megatron-LM's (``training_log`` and ``evaluate_and_print_results`` in
``megatron/training/training.py``, NVIDIA/Megatron-LM core_r0.11.0, commit 7c00175e6b24b3cd835d21a9d287c35a07e275b3),
each also written against consumed samples as ``<tag> vs samples``, so Megatron dashboards read our runs.
MLflow (``domino.tracking``, when ``MLFLOW_TRACKING_URI`` is set) gets the same tags at the iteration, without
the ``vs samples`` twins (it has one step axis). Only global rank 0 writes; every other rank holds a disabled
writer so call sites need no rank checks.

These are side files: a failure to write one (a full disk, a volume gone read-only) is said in one warning and
that destination is left for the rest of the run, while training goes on. The checkpoint is the one write whose
failure stops a run; MLflow never raises (``domino.tracking.session``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from domino.atomic_files import atomic_write_text
from domino.tracking import RunTracker, start_training_run
from domino.tracking.trainer_status import TrainerStatusPoster
from domino.train.stragglers import format_stragglers

logger = logging.getLogger(__name__)


def _format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def format_iteration_line(r: Dict[str, Any], train_iters: int) -> str:
    """The one-line summary of a logging interval (Megatron's layout, plus MFU, memory and ETA)."""
    parts = [
        f"iteration {r['iteration']:>6d}/{train_iters}",
        f"consumed samples {r['consumed_samples']}",
        f"lm loss {r['lm_loss']:.4E}",
        f"lr {r['lr']:.3E}",
        f"grad norm {r['grad_norm']:.3f}" if r.get("grad_norm") is not None else "grad norm n/a",
    ]
    if r.get("loss_scale") is not None:
        parts.append(f"loss scale {r['loss_scale']:.1f}")
    parts += [
        f"skipped {r['skipped_iterations']}",
        f"iter time {1000 * r['iteration_time_s']:.1f} ms",
        f"tokens/s {r['tokens_per_s']:,.0f}",
        f"TFLOP/s/device {r['tflops_per_device']:.2f}",
    ]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts += [f"mem {r['memory_gb']:.2f} GB", f"ETA {_format_duration(r['eta_s'])}"]
    straggling = format_stragglers(r)
    if straggling:
        parts.append(straggling)
    return " | ".join(parts)


#: Training record field -> Megatron's TensorBoard tag (written with a ``... vs samples`` twin).
TRAIN_TAGS = {"lr": "learning-rate", "batch_size": "batch-size", "lm_loss": "lm loss", "loss_scale": "loss-scale",
              "grad_norm": "grad-norm"}
#: Written only with ``--log-timers-to-tensorboard``, as Megatron does (iteration-time only, no samples twin).
TIMER_TAGS = {"iteration_time_s": "iteration-time", "tflops_per_device": "throughput"}
#: domino's own numbers, under their own tags.
EXTRA_TAGS = {"tokens_per_s": "tokens-per-second", "mfu": "mfu", "memory_gb": "memory-gb"}


def tensorboard_scalars(record: Dict[str, Any], log_timers: bool = False) -> List[Tuple[str, float, int]]:
    """``(tag, value, step)`` triples of a metrics record, with Megatron-LM's tag names.

    A training record gives ``learning-rate``, ``batch-size``, ``lm loss``, ``loss-scale`` and ``grad-norm``
    at the iteration and as ``... vs samples`` at the consumed samples; an evaluation record gives
    ``lm loss validation`` and ``lm loss validation ppl`` (Megatron writes its test loss under the same tag;
    here a test record writes ``lm loss test`` so the two stay apart).
    """
    iteration, samples = record.get("iteration", 0), record.get("consumed_samples")
    scalars: List[Tuple[str, float, int]] = []

    def add(tag: str, value: Any, twin: bool = True) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            scalars.append((tag, float(value), iteration))
            if twin and samples is not None:
                scalars.append((f"{tag} vs samples", float(value), samples))

    if "eval" in record:
        name = "validation" if record["eval"] == "valid" else record["eval"]
        add(f"lm loss {name}", record.get("lm_loss"))
        add(f"lm loss {name} ppl", record.get("ppl"))
        return scalars
    for key, tag in TRAIN_TAGS.items():
        add(tag, record.get(key))
    if log_timers:
        for key, tag in TIMER_TAGS.items():
            add(tag, record.get(key), twin=False)
    for key, tag in EXTRA_TAGS.items():
        add(tag, record.get(key), twin=False)
    add("straggler/slowest_ratio", record.get("straggler_slowest_ratio"), twin=False)  # --log-straggler
    add("goodput/goodput", record.get("goodput"), twin=False)  # the run's, over all attempts (domino.goodput)
    for part, seconds in (record.get("goodput_s") or {}).items():
        add(f"goodput/{part}", seconds, twin=False)
    return scalars


def tracking_scalars(record: Dict[str, Any]) -> List[Tuple[str, float, int]]:
    """The record's Megatron-named scalars at its iteration, timers included (what MLflow gets)."""
    iteration = record.get("iteration", 0)
    return [(tag, value, step) for tag, value, step in tensorboard_scalars(record, log_timers=True)
            if step == iteration and not tag.endswith(" vs samples")]


def _quiet_tensorboard_thread() -> None:
    """Keeps Python from printing the traceback of TensorBoard's writer thread when a write fails: the thread
    stores its error, then raises it again (``_AsyncWriterThread.run`` in
    ``tensorboard/summary/writer/event_file_writer.py``, tensorboard 2.21.0), so :meth:`MetricsWriter._side`
    gets the same error at the next call and says it in one line."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "domino_tensorboard", False):
        return

    def hook(args) -> None:
        if not isinstance(args.thread, _AsyncWriterThread):
            previous(args)

    hook.domino_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class MetricsWriter:
    """Appends metrics records to ``--metrics-file``, TensorBoard and an MLflow run (rank 0 only).

    Args:
        metrics_file: ``--metrics-file``.
        tensorboard_dir: ``--tensorboard-dir``.
        enabled: Whether this process writes (global rank 0).
        log_timers: ``--log-timers-to-tensorboard``.
        metrics_port: ``--metrics-port``: serve the records' numbers to Prometheus (0: off).
        train_iters: The run's last iteration: inside a TrainJob whose Trainer injects its status endpoint, the
            records' progress goes to the TrainJob's ``status.trainerStatus`` (``domino.tracking.trainer_status``).
    """

    def __init__(self, metrics_file: Optional[str], tensorboard_dir: Optional[str], enabled: bool,
                 log_timers: bool = False, metrics_port: int = 0, train_iters: Optional[int] = None) -> None:
        self.enabled = enabled
        self.trainjob_status = TrainerStatusPoster.from_env(train_iters) if enabled and train_iters else None
        self.failed: Set[str] = set()  # the side files given up after their first failure
        self.exporter = None
        if enabled and metrics_port:
            from domino.train.prometheus import PrometheusExporter

            self.exporter = PrometheusExporter(metrics_port)
        self.log_timers = log_timers
        self.tracker: Optional[RunTracker] = None
        self.metrics_file = metrics_file if enabled else None
        self._tb = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            self._tb = self._side("--tensorboard-dir", tensorboard_dir,
                                  lambda: SummaryWriter(log_dir=tensorboard_dir))
        if self.metrics_file:
            self._side("--metrics-file", self.metrics_file,
                       lambda: os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True))

    def _side(self, flag: str, path: str, write: Callable[[], Any]) -> Any:
        """Runs one write to a side file and returns its result; on an ``OSError`` says so once and gives the
        file up (None). TensorBoard's writer thread keeps its error and raises it at the next call
        (``_AsyncWriter`` in ``tensorboard/summary/writer/event_file_writer.py``, tensorboard 2.21.0): caught here
        too."""
        if flag in self.failed:
            return None
        try:
            return write()
        except OSError as error:
            self.failed.add(flag)
            text = " ".join(str(error).split())[:300]
            logger.warning("%s %s: write failed (%s: %s); training goes on without it, nothing more is written "
                           "there (the checkpoint is not affected)", flag, path, type(error).__name__, text)
            return None

    def track(self, config_dict: Dict[str, Any], logging_config, save_root: Optional[str], iteration: int,
              derived: Dict[str, Any]) -> None:
        """Opens the MLflow run (continued from ``save_root``'s pointer on resume) when tracking is on.

        Args:
            config_dict: The resolved config, the run's parameters (logged when the run is created).
            logging_config: The run's ``LoggingConfig`` (the ``--mlflow-*`` names).
            save_root: ``--save``, where the run pointer lives.
            iteration: The iteration training starts at.
            derived: Settings derived from the config and the world (logged as parameters too).
        """
        if self.enabled and self.tracker is None:
            self.tracker = start_training_run(config_dict, save_root, logging_config.mlflow_experiment_name,
                                              logging_config.mlflow_run_name, iteration, derived)

    def drop_after(self, iteration: int) -> None:
        """Removes records past ``iteration`` (a resumed run re-logs what the killed run logged after its
        last checkpoint); the file is rewritten atomically so a kill here loses nothing."""
        if self.metrics_file and os.path.exists(self.metrics_file):
            self._side("--metrics-file", self.metrics_file, lambda: self._rewrite_up_to(iteration))

    def _rewrite_up_to(self, iteration: int) -> None:
        kept = []
        with open(self.metrics_file) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill mid-write
                if record.get("iteration", 0) <= iteration:
                    kept.append(json.dumps(record))
        atomic_write_text(self.metrics_file, "".join(line + "\n" for line in kept))

    def write(self, record: Dict[str, Any]) -> None:
        """Appends one JSON record and mirrors its numeric fields to TensorBoard."""
        if not self.enabled:
            return
        if self.metrics_file:
            self._side("--metrics-file", self.metrics_file, lambda: self._append(record))
        if self._tb is not None:
            self._side("--tensorboard-dir", self._tb.log_dir, lambda: self._add_scalars(record))
        if self.tracker is not None:  # queued: the tracker's thread talks to the server
            self.tracker.log_metrics(tracking_scalars(record))
        if self.exporter is not None and "eval" not in record:
            self.exporter.update(record)
        if self.trainjob_status is not None and "eval" not in record:  # posted from its own thread
            self.trainjob_status.offer(record)

    def _append(self, record: Dict[str, Any]) -> None:
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def _add_scalars(self, record: Dict[str, Any]) -> None:
        for tag, value, step in tensorboard_scalars(record, self.log_timers):
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def close(self, completed: bool = True) -> None:
        """Flushes and closes TensorBoard; attaches the metrics file to the MLflow run and ends it (a completed
        run is marked finished; waiting for the server is bounded)."""
        if self._tb is not None:
            self._side("--tensorboard-dir", self._tb.log_dir, self._tb.close)
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        if self.trainjob_status is not None:  # a finished run's 100 % waits for the pacing, boundedly
            self.trainjob_status.close(completed)
            self.trainjob_status = None
        if self.tracker is not None:
            self.tracker.log_artifact(self.metrics_file)
            self.tracker.finish(completed)
            self.tracker = None
