"""Helpers for tests of the scripts in benchmarks/ (which are not a package)."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def load_benchmark(name: str):
    """The module ``benchmarks/<name>.py``, freshly executed.

    Some scripts put ``benchmarks/`` on ``sys.path`` to import their siblings. Left there, anywhere, it would
    shadow the tests' own folders for the rest of the session: ``tests/train`` is a namespace package, and the
    import system takes a plain module (``benchmarks/train.py``) from any entry before a namespace portion (PEP 420,
    "Specification": portions are recorded and used only when no regular package or module is found), also
    in every rank forked later, which inherits ``sys.path``. So ``sys.path`` is restored once the script is loaded.
    """
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
