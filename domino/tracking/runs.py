"""Which MLflow run a checkpoint belongs to, and the names runs and metrics get.

A training run that saves checkpoints writes ``<--save>/.mlflow-run.json`` (the tracking URI, experiment id
and run id) once its MLflow run exists, so a resumed run (the same ``--save``) continues that run and
``domino evaluate --load`` logs to the run it evaluates. The leading dot keeps the file out of the checkpoint
folder's listing that resume checks (``domino/checkpoint/resume.py`` ignores dot files); it is written
atomically like every other file. The save root is on a volume many people read, so the pointer holds the URI
without its secrets (:func:`domino.redact.redact_uri`), and a pointer matches a server by that form.

Parameters are the resolved config, one per field, named like the field (the flag without dashes); a URI in a
value is written without its secrets.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from domino.atomic_files import atomic_write_text
from domino.redact import redact_text, redact_uri

#: The run pointer's name inside a checkpoint save root.
POINTER_FILE = ".mlflow-run.json"
#: Experiment of runs that name none (flag and ``MLFLOW_EXPERIMENT_NAME`` unset).
DEFAULT_EXPERIMENT = "domino"
#: Environment variable through which the pipeline's pretrain step hands its KFP run id to the training job.
KFP_RUN_ID_ENV = "DOMINO_KFP_RUN_ID"
#: Tag of an MLflow run that holds the id of the KFP run that made it.
KFP_RUN_TAG = "kfp.run_id"


@dataclass(frozen=True)
class RunPointer:
    """The MLflow run of a save root.

    Attributes:
        tracking_uri: The server the run lives on, without secrets (a pointer to another server is not followed).
        experiment_id: The run's experiment.
        run_id: The run.
    """

    tracking_uri: str
    experiment_id: str
    run_id: str


def pointer_path(save_root: str) -> str:
    """Where the run pointer of ``save_root`` lives."""
    return os.path.join(save_root, POINTER_FILE)


def write_pointer(save_root: str, pointer: RunPointer) -> None:
    """Records ``pointer`` in ``save_root`` (created if needed), atomically, its URI without secrets."""
    os.makedirs(save_root, exist_ok=True)
    record = dataclasses.asdict(dataclasses.replace(pointer, tracking_uri=redact_uri(pointer.tracking_uri)))
    atomic_write_text(pointer_path(save_root), json.dumps(record, sort_keys=True) + "\n")


def read_pointer(path: str, tracking_uri: Optional[str] = None) -> Optional[RunPointer]:
    """The run pointer of a save root or of one of its ``iter_*`` checkpoints; None when there is none, when it
    is unreadable, or when it names a server other than ``tracking_uri`` (given)."""
    for folder in (Path(path), Path(path).parent):
        candidate = folder / POINTER_FILE
        if not candidate.is_file():
            continue
        try:
            data = json.loads(candidate.read_text(encoding="utf-8"))
            pointer = RunPointer(**{f.name: str(data[f.name]) for f in dataclasses.fields(RunPointer)})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if tracking_uri is not None and pointer.tracking_uri != redact_uri(tracking_uri):
            return None
        return pointer
    return None


def flat_params(config_dict: Dict[str, Any], extra: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
    """The resolved config as MLflow parameters: one per field, named like its flag without dashes
    (``num_layers``), lists space-joined, ``None`` as an empty string."""
    params: Dict[str, str] = {}
    for key, value in config_dict.items():
        if isinstance(value, dict):
            params.update(flat_params(value))
        else:
            params[key] = _param_text(value)
    for key, value in (extra or {}).items():
        params[key] = _param_text(value)
    return params


def _param_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return redact_text(" ".join(map(str, value)))
    return redact_text(str(value))


def now_ms() -> int:
    """MLflow's timestamps: milliseconds since the epoch."""
    return int(time.time() * 1000)
