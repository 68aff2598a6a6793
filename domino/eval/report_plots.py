"""The report's plots: training metrics drawn with matplotlib and embedded as base64 PNG data URIs."""

from __future__ import annotations

import base64
import io
import json
import logging
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from matplotlib.figure import Figure

from domino.config import ConfigError

logger = logging.getLogger(__name__)

Record = Dict[str, Any]


def read_metrics(path: Path) -> Tuple[List[Record], List[Record]]:
    """Reads a ``--metrics-file`` JSONL into (training records, evaluation records).

    Lines that are not JSON objects (a truncated last line of a run still writing, a line garbled by a
    full disk or by hand) are skipped and counted in a warning naming the file and the first such line.

    Raises:
        ConfigError: when the file is missing.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--metrics-file {path} does not exist")
    train: List[Record] = []
    evals: List[Record] = []
    skipped: List[str] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as error:  # JSONDecodeError, huge integers, deep nesting
                skipped.append(f"line {number}: not JSON ({' '.join(str(error).split())[:80]})")
                continue
            if not isinstance(record, dict):
                skipped.append(f"line {number}: not a JSON object")
            elif "eval" in record:
                evals.append(record)
            elif "iteration" in record:
                train.append(record)
    if skipped:
        logger.warning("%s: skipped %d malformed line(s), first %s", path, len(skipped), skipped[0])
    return train, evals


#: Values beyond this magnitude are not drawn: matplotlib's tick locator computes the axis span, which overflows
#: to inf for values near the largest float (``np.arange: cannot compute length`` for a loss of +-1e308), and no
#: metric of a run means anything out there (a diverged loss is seen at any smaller value just as well).
PLOT_LIMIT = 1e100


def _series(records: Sequence[Record], key: str) -> Tuple[List[float], List[float]]:
    xs, ys, off = [], [], 0
    for record in records:
        value, iteration = record.get(key), record.get("iteration")
        if not (isinstance(value, (int, float)) and math.isfinite(value) and isinstance(iteration, (int, float))
                and math.isfinite(iteration)):
            continue
        if abs(value) > PLOT_LIMIT or abs(iteration) > PLOT_LIMIT:
            off += 1
            continue
        xs.append(iteration)
        ys.append(value)
    if off:
        logger.warning("report: %d %s value(s) beyond +-%g are not drawn", off, key, PLOT_LIMIT)
    return xs, ys


def figure_to_data_uri(figure: Figure) -> str:
    """The figure as a ``data:image/png;base64,...`` URI (self-contained; no file beside the report)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def loss_figure(train: Sequence[Record], evals: Sequence[Record], warmup_iters: int = 0) -> Optional[Figure]:
    """Training loss per logged iteration with validation and test losses as marked points, and the
    learning-rate warm-up (its first ``warmup_iters`` iterations) shaded; ``None`` with nothing to draw."""
    figure = Figure(figsize=(7, 3.6))
    axes = figure.add_subplot()
    drawn = False
    if warmup_iters > 0 and train:
        axes.axvspan(0, warmup_iters, color="tab:red", alpha=0.12,
                     label=f"learning-rate warm-up ({warmup_iters} iterations)")
    xs, ys = _series(train, "lm_loss")
    if xs:
        axes.plot(xs, ys, label="training", color="tab:blue")
        drawn = True
    for split, color in (("valid", "tab:orange"), ("test", "tab:green")):
        xs, ys = _series([r for r in evals if r.get("eval") == split], "lm_loss")
        if xs:
            axes.plot(xs, ys, marker="o", label=f"{'validation' if split == 'valid' else 'test'} "
                      f"({len(xs)} evaluation{'' if len(xs) == 1 else 's'})", color=color)
            drawn = True
    if not drawn:
        return None
    axes.set_xlabel("iteration")
    axes.set_ylabel("LM loss (nats/token)")
    axes.set_title("Loss")
    axes.grid(alpha=0.3)
    axes.legend()
    return figure


def throughput_figure(train: Sequence[Record]) -> Optional[Figure]:
    """Tokens/s (and TFLOP/s per device when logged) over iterations; ``None`` with nothing to draw."""
    xs, ys = _series(train, "tokens_per_s")
    if not xs:
        return None
    figure = Figure(figsize=(7, 3.6))
    axes = figure.add_subplot()
    axes.plot(xs, ys, color="tab:purple", label="tokens/s")
    axes.set_xlabel("iteration")
    axes.set_ylabel("tokens / s")
    axes.set_title("Throughput")
    axes.grid(alpha=0.3)
    fx, fy = _series(train, "tflops_per_device")
    if fx:
        twin = axes.twinx()
        twin.plot(fx, fy, color="tab:gray", linestyle="--", label="TFLOP/s per device")
        twin.set_ylabel("TFLOP/s per device")
        handles = axes.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        axes.legend(handles=handles, loc="lower right")
    return figure


def schedule_figure(train: Sequence[Record]) -> Optional[Figure]:
    """Learning rate and gradient norm over iterations; ``None`` when neither was logged."""
    lx, ly = _series(train, "lr")
    gx, gy = _series(train, "grad_norm")
    if not lx and not gx:
        return None
    figure = Figure(figsize=(7, 3.6))
    axes = figure.add_subplot()
    axes.set_xlabel("iteration")
    axes.set_title("Learning rate and gradient norm")
    if lx:
        axes.plot(lx, ly, color="tab:red", label="learning rate")
        axes.set_ylabel("learning rate")
    if gx:
        twin = axes.twinx() if lx else axes
        twin.plot(gx, gy, color="tab:cyan", label="gradient norm")
        twin.set_ylabel("gradient norm")
    axes.grid(alpha=0.3)
    return figure



#: The goodput parts in the order a bar stacks them (an attempt's life from left to right), with their colours.
GOODPUT_BARS = (("idle_s", "idle before it", "tab:gray"), ("startup_s", "start-up", "tab:orange"),
                ("productive_s", "productive", "tab:green"), ("checkpoint_s", "checkpoint saves", "tab:blue"),
                ("evaluation_s", "evaluation", "tab:purple"), ("lost_s", "lost (run again)", "tab:red"),
                ("other_s", "other", "tab:olive"))


def goodput_figure(report) -> Optional[Figure]:
    """One stacked bar per attempt of where its seconds went (a :class:`domino.goodput.accounting.GoodputReport`);
    ``None`` without attempts."""
    if report is None or not report.attempts:
        return None
    figure = Figure(figsize=(7, 0.9 + 0.45 * len(report.attempts)))
    axes = figure.add_subplot()
    names = [f"{index + 1}: {attempt.how}" for index, attempt in enumerate(report.attempts)]
    left = [0.0] * len(names)
    for field, label, color in GOODPUT_BARS:
        widths = [getattr(attempt, field) for attempt in report.attempts]
        axes.barh(names, widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    axes.invert_yaxis()  # the first attempt on top
    axes.set_xlabel("seconds")
    axes.set_title(f"Where each attempt's time went: goodput {100 * report.goodput:.1f} %")
    axes.legend(loc="lower center", bbox_to_anchor=(0.5, 1.12), ncol=4, fontsize="small")
    axes.grid(axis="x", alpha=0.3)
    return figure
