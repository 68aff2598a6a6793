"""Evaluation, generation, Hugging Face interop and the HTML run report. See ``docs/evaluation.md``.

Names are imported on first use, so ``import domino.eval`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "evaluate_checkpoint": "domino.eval.evaluate",
    "EvalSettings": "domino.eval.settings",
    "evaluate_batches": "domino.eval.metrics",
    "vocab_parallel_argmax": "domino.eval.metrics",
    "Generation": "domino.eval.generate",
    "generate": "domino.eval.generate",
    "generate_ids": "domino.eval.generate",
    "generate_samples": "domino.eval.generate",
    "SamplingConfig": "domino.eval.sampling",
    "export_hf": "domino.checkpoint.hf_interop",
    "import_hf": "domino.checkpoint.hf_interop",
    "write_report": "domino.eval.report",
    "read_metrics": "domino.eval.report_plots",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'domino.eval' has no attribute {name!r}")
