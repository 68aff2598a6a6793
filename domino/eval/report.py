"""A self-contained HTML report of a run: loss and throughput plots, evaluation table, config, samples.

The report is one file with no external assets (plots are base64 PNGs, the style sheet is inline), so it
can be published as a Kubeflow ``Output[HTML]`` artifact or mailed around as is.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from domino.config import ConfigError, DominoConfig, config_to_dict
from domino.eval.report_plots import (
    figure_to_data_uri,
    goodput_figure,
    loss_figure,
    read_metrics,
    schedule_figure,
    throughput_figure,
)
from domino.atomic_files import atomic_write_text
from domino.goodput.accounting import account
from domino.goodput.ledger import LEDGER_FILE, read_events

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { border-bottom: 2px solid #ccc; } h2 { margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; } td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; }
th { background: #f3f3f3; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; } pre { background: #f7f7f7; padding: 0.6em; white-space: pre-wrap; }
.prompt { color: #555; } .completion { color: #0a5; font-weight: 600; }
"""

EVAL_COLUMNS = ("loss", "ppl", "accuracy", "tokens")


def _fmt(value: Any) -> str:
    if value is None:
        return "not recorded"
    if isinstance(value, bool):
        return html.escape(str(value))
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return html.escape(" ".join(str(v) for v in value)) or "&mdash;"
    return html.escape(str(value))


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{_fmt(v)}</td>' if isinstance(v, (int, float)) and not isinstance(v, bool)
            else f"<td>{_fmt(v)}</td>" for v in row)
        body.append(f"<tr>{cells}</tr>")
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _normalise_eval_results(eval_results: Any, source: str = "evaluation results") -> List[Dict[str, Any]]:
    """Accepts one result dict, a list of them, or ``{name: result}``; returns named rows.

    Raises:
        ConfigError: naming ``source`` and the entry, for anything else (a value of a column that is not a
            number, an entry that is not an object).
    """
    if eval_results is None:
        return []
    if isinstance(eval_results, Mapping) and any(k in eval_results for k in EVAL_COLUMNS):
        rows = [{**eval_results, "name": eval_results.get("name") or eval_results.get("data") or "evaluation"}]
    elif isinstance(eval_results, (Mapping, list, tuple)):
        named = eval_results.items() if isinstance(eval_results, Mapping) else (
            (r.get("name", f"evaluation {i + 1}") if isinstance(r, Mapping) else f"{i + 1}", r)
            for i, r in enumerate(eval_results))
        rows = []
        for name, result in named:
            if not isinstance(result, Mapping):
                raise ConfigError(f"{source}: entry {str(name)!r} is a {type(result).__name__}, expected an object")
            rows.append({"name": str(name), **result})
    else:
        raise ConfigError(f"{source}: expected an evaluation result (an object with {', '.join(EVAL_COLUMNS)}), a "
                          f"list of them or an object of them by name, got {type(eval_results).__name__}")
    for row in rows:
        for column in EVAL_COLUMNS:
            value = row.get(column)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{source}: entry {row['name']!r} has {column}={value!r}, expected a number")
    return rows


def _eval_section(eval_results: Any, metric_evals: Sequence[Dict[str, Any]]) -> str:
    rows = [[r["name"], *(r.get(c) for c in EVAL_COLUMNS)] for r in _normalise_eval_results(eval_results)]
    # The last evaluation of each split logged during training complements the explicit results; training
    # logs loss and perplexity only, so the other cells say so instead of staying empty.
    last: Dict[str, Dict[str, Any]] = {}
    for record in metric_evals:
        last[record["eval"]] = record
    for split, record in last.items():
        rows.append([f"{split} (logged in training, iteration {record.get('iteration')})",
                     record.get("lm_loss"), record.get("ppl"), record.get("accuracy"), record.get("tokens")])
    if not rows:
        return "<p>No evaluation results.</p>"
    rows = [[name, loss, ppl, "not logged" if accuracy is None else f"{100 * accuracy:.1f} %",
             "not logged" if tokens is None else tokens] for name, loss, ppl, accuracy, tokens in rows]
    return _table(["evaluation", "loss (nats/token)", "perplexity", "next-token accuracy", "tokens"], rows,
                  "evaluation")


def _config_section(config: Union[DominoConfig, Mapping[str, Any], None]) -> str:
    if config is None:
        return "<p>No configuration given.</p>"
    data = config_to_dict(config) if dataclasses.is_dataclass(config) else dict(config)
    rows = []
    for group, values in data.items():
        items = values.items() if isinstance(values, Mapping) else [(None, values)]
        # An unset optional setting (None, an empty list) has no value to show: it is left out.
        rows.extend([f"{group}.{key}" if key else group, value] for key, value in items
                    if value is not None and value != [])
    return ("<p>The resolved training configuration; settings left unset are not listed.</p>"
            + _table(["setting", "value"], rows, "config"))


def _samples_section(samples: Optional[Sequence[Mapping[str, Any]]], notes: Sequence[str] = ()) -> str:
    if not samples:
        return "<p>No sample generations.</p>"
    items = [f"<p>{html.escape(note)}</p>" for note in notes]
    for sample in samples:
        prompt = html.escape(str(sample.get("prompt", "")))
        completion = html.escape(str(sample.get("completion", sample.get("text", ""))))
        items.append(f'<pre class="sample"><span class="prompt">{prompt}</span>'
                     f'<span class="completion">{completion}</span></pre>')
    return "\n".join(items)


#: The training summary's rows: metrics-file key, label with unit, format.
_SUMMARY_ROWS = (
    ("iteration", "iterations", "{:,}"), ("consumed_samples", "samples consumed", "{:,}"),
    ("lm_loss", "training loss (nats/token)", "{:.4f}"), ("tokens_per_s", "throughput (tokens/s)", "{:,.0f}"),
    ("tflops_per_device", "model TFLOP/s per device", "{:.3f}"), ("mfu", "MFU (% of peak)", "{:.1%}"),
    ("memory_gb", "peak memory (GB)", "{:.2f}"),
)


def _summary_section(train: Sequence[Dict[str, Any]]) -> str:
    if not train:
        return "<p>No training iterations were logged.</p>"
    last = train[-1]
    rows = []
    for key, label, spec in _SUMMARY_ROWS:
        value = last.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append([label, spec.format(value)])
        elif key == "mfu" and "mfu" in last:
            rows.append([label, "not measured: no reference peak for this device (give --peak-tflops)"])
    return _table(["metric", "last logged value"], rows, "summary")


def _run_section(run_info: Sequence[Tuple[str, str]]) -> str:
    if not run_info:
        return ""
    return "<h2>What ran</h2>\n" + _table(["what", "details"], [list(row) for row in run_info], "what-ran")


def _warmup_iters(config: Union[DominoConfig, Mapping[str, Any], None]) -> int:
    """Warm-up iterations of the learning-rate schedule (0 when unknown)."""
    if config is None:
        return 0
    data = config_to_dict(config) if dataclasses.is_dataclass(config) else dict(config)
    train = data.get("train") or {}
    if train.get("lr_warmup_fraction") and (train.get("lr_decay_iters") or train.get("train_iters")):
        return int(train["lr_warmup_fraction"] * (train.get("lr_decay_iters") or train["train_iters"]))
    return int(train.get("lr_warmup_iters") or 0)


def write_report(
    output_html: Union[str, Path],
    metrics_file: Union[str, Path, None],
    eval_results: Any = None,
    config: Union[DominoConfig, Mapping[str, Any], None] = None,
    samples: Optional[Sequence[Mapping[str, Any]]] = None,
    title: str = "domino run report",
    run_info: Sequence[Tuple[str, str]] = (),
    notes: Sequence[str] = (),
    save_root: Union[str, Path, None] = None,
) -> Path:
    """Writes the run report as one self-contained HTML file.

    Args:
        output_html: the file to write (parent directories are created; written atomically).
        metrics_file: the run's ``--metrics-file`` JSONL (``None``: no plots).
        eval_results: one result of :func:`domino.eval.evaluate_checkpoint`, a list of them, or
            ``{name: result}``.
        config: the run's ``DominoConfig`` or its ``config_to_dict`` form.
        samples: generations as ``{"prompt": str, "completion": str}`` dicts.
        title: the page title.
        run_info: ``(what, sentence)`` rows of the "What ran" section (layout, tokens seen, wall time, ...).
        notes: sentences shown above the samples (how they were sampled, how many words are corpus words).
        save_root: the run's ``--save``: its goodput ledger gives the "Goodput" section (none without a ledger).

    Returns:
        The path of the written report.
    """
    train, evals = read_metrics(Path(metrics_file)) if metrics_file is not None else ([], [])
    plots = []
    for name, figure in (("loss", loss_figure(train, evals, _warmup_iters(config))), ("throughput", throughput_figure(train)),
                         ("schedule", schedule_figure(train))):
        if figure is not None:
            plots.append(f'<figure><img id="plot-{name}" alt="{name} plot" src="{figure_to_data_uri(figure)}">'
                         "</figure>")
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = f" from {html.escape(str(metrics_file))}" if metrics_file is not None else ""
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p>Generated {created}{source}.</p>
{_run_section(run_info)}
<h2>Training</h2>
{_summary_section(train)}
{"".join(plots) or "<p>No training metrics to plot.</p>"}
{_goodput_section(save_root)}
<h2>Evaluation</h2>
{_eval_section(eval_results, evals)}
<h2>Sample generations</h2>
{_samples_section(samples, notes)}
<h2>Configuration</h2>
{_config_section(config)}
</body></html>
"""
    output = Path(output_html)
    atomic_write_text(output, page)
    return output


def _goodput_section(save_root: Union[str, Path, None]) -> str:
    """The run's goodput over its attempts (``domino goodput``): the line and a stacked bar per attempt."""
    if save_root is None or not (Path(save_root) / LEDGER_FILE).is_file():
        return ""
    report = account(read_events(str(save_root)))
    figure = goodput_figure(report)
    image = (f'<figure><img id="plot-goodput" alt="goodput per attempt" src="{figure_to_data_uri(figure)}">'
             "</figure>") if figure is not None else ""
    return f"<h2>Goodput</h2>\n<p>{html.escape(report.line())}</p>\n{image}"


def load_eval_json(path: Union[str, Path]) -> Any:
    """Reads an ``--eval-json`` file (the output of ``domino evaluate --json``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--eval-json {path} does not exist")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"--eval-json {path} is not valid JSON: {error}") from None
    _normalise_eval_results(results, f"--eval-json {path}")  # checked before any work
    return results
