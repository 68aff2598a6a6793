"""The pipeline's run parameters: ``--param name=value`` parsing and checks done before any run starts.

Types and defaults come from the pipeline itself (its kfp component spec), so the command line, the
docs table and the compiled YAML can never disagree about which parameters exist.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}

from components.pretrain.settings import JSON_SETTINGS
from domino.launch.api import BACKENDS
from domino.launch.job_api import JOB_APIS
from domino.launch.spec import PARALLEL_LAYOUTS

#: Parameters whose values are JSON, with the JSON type they must have.
JSON_PARAMETERS = JSON_SETTINGS
#: Parameters with a fixed set of values.
CHOICES = {"backend": BACKENDS, "job_api": tuple(JOB_APIS), "parallel_layout": PARALLEL_LAYOUTS}


class ParamError(ValueError):
    """A ``--param`` that names no parameter or has a value of the wrong type; the message names it."""


@dataclass(frozen=True)
class ParamInfo:
    """One pipeline parameter: ``type`` is kfp's (String, Integer, Float, Boolean)."""

    name: str
    type: str
    default: Any
    description: str


def pipeline_parameters(pipeline: Any = None) -> Dict[str, ParamInfo]:
    """The parameters of ``pipeline`` (default: the gpt-pretrain pipeline) in declaration order."""
    if pipeline is None:
        from pipelines.gpt_pretrain import build_pipeline

        pipeline = build_pipeline()
    return {
        name: ParamInfo(name, spec.type, spec.default, " ".join((spec.description or "").split()))
        for name, spec in pipeline.component_spec.inputs.items()
    }


def markdown_table(parameters: Optional[Dict[str, ParamInfo]] = None) -> str:
    """The parameters as the Markdown table of ``docs/pipeline.md`` (``domino pipeline params --markdown``)."""
    parameters = parameters if parameters is not None else pipeline_parameters()
    rows = ["| parameter | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{p.name}` | {p.type.lower()} | `{json.dumps(p.default)}` | {p.description} |"
             for p in parameters.values()]
    return "\n".join(rows) + "\n"


def convert(info: ParamInfo, text: str) -> Any:
    """``text`` converted to the parameter's type; raises :class:`ParamError` naming the parameter."""
    try:
        if info.type == "Integer":
            return int(text)
        if info.type == "Float":
            return float(text)
    except ValueError:
        raise ParamError(f"--param {info.name}={text}: expected {info.type.lower()}") from None
    if info.type == "Boolean":
        lowered = text.strip().lower()
        if lowered in _TRUE or lowered in _FALSE:
            return lowered in _TRUE
        raise ParamError(f"--param {info.name}={text}: expected true or false")
    return text


def parse_param_args(items: Iterable[str], parameters: Optional[Dict[str, ParamInfo]] = None) -> Dict[str, Any]:
    """Parses ``["name=value", ...]`` into typed values and checks them (see :func:`check_params`).

    Raises:
        ParamError: malformed item, unknown name (with close matches), wrong type or bad value.
    """
    parameters = parameters if parameters is not None else pipeline_parameters()
    values: Dict[str, Any] = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or not name:
            raise ParamError(f"--param {item!r}: expected NAME=VALUE")
        if name not in parameters:
            close = difflib.get_close_matches(name, list(parameters), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(parameters)}"
            raise ParamError(f"--param {name}: the pipeline has no such parameter{hint}")
        values[name] = convert(parameters[name], text)
    check_params(values)
    return values


def check_params(values: Dict[str, Any]) -> None:
    """Checks values whose type alone does not make them valid: JSON parameters, choices, ranges."""
    problems: List[str] = []
    for name, kind in JSON_PARAMETERS.items():
        if name in values:
            try:
                parsed = json.loads(values[name])
            except json.JSONDecodeError as error:
                problems.append(f"--param {name}: not JSON ({error})")
                continue
            if not isinstance(parsed, kind):
                problems.append(f"--param {name}: expected a JSON {'object' if kind is dict else 'array'}")
    for name, choices in CHOICES.items():
        if name in values and values[name] not in choices:
            problems.append(f"--param {name}={values[name]}: expected one of {', '.join(map(str, choices))}")
    # The config fields' ranges are checked with the whole training config (check_training_config).
    for name in ("nodes", "nproc_per_node", "eval_micro_batch_size", "preprocess_groups", "preprocess_workers"):
        if name in values and values[name] < 1:
            problems.append(f"--param {name}={values[name]}: must be at least 1")
    for name in ("gpus_per_node", "eval_batches", "job_timeout_s", "sample_tokens", "queue_timeout_s", "termination_grace_period_s"):
        if name in values and values[name] < 0:
            problems.append(f"--param {name}={values[name]}: must not be negative")
    if "backoff_limit" in values and values["backoff_limit"] < -1:
        problems.append(f"--param backoff_limit={values['backoff_limit']}: must be -1 (3 x nodes) or more")
    if values.get("tokenizer_vocab_size", 0) != 0 and values["tokenizer_vocab_size"] < 257:
        problems.append(f"--param tokenizer_vocab_size={values['tokenizer_vocab_size']}: must be 0 (use the "
                        "tokenizer parameter) or at least 257 (256 bytes + end-of-document)")
    if "min_improvement" in values and not 0.0 <= values["min_improvement"] < 1.0:
        problems.append(f"--param min_improvement={values['min_improvement']}: must be in [0, 1)")
    if problems:
        raise ParamError("; ".join(problems))


def check_training_config(values: Dict[str, Any]) -> None:
    """Validates the training configuration the parameters imply, as the pretrain step will.

    Raises:
        ParamError: the message names the offending flag (e.g. ``--micro-batch-size``).
    """
    from components.layout import RunLayout
    from components.declare import settings_from_values
    from components.pretrain.step import PretrainSettings, job_spec, pretrain_argv
    from domino.launch.pretrain_args import resolve_pretrain
    from domino.config import ConfigError

    defaults = {name: info.default for name, info in pipeline_parameters().items()}
    settings = settings_from_values(PretrainSettings, {**defaults, **values, "run_id": "check", "warm_start": False})
    layout = RunLayout(settings.shared_root, settings.run_id)
    try:
        argv = pretrain_argv(settings, "dataset", layout)
        resolve_pretrain(job_spec(settings, argv))  # what the pretrain step resolves and checks when it runs
    except (ConfigError, ValueError) as error:
        raise ParamError(f"the parameters give an invalid training config: {error}") from None
