"""Helpers for tests of the scripts in benchmarks/ (which are not a package)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    """The module ``benchmarks/<name>.py``, freshly executed."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
