"""The mutation check (tests/mutations/run.py) stays runnable: every mutation's snippet occurs exactly once in its
file, so none has gone stale unnoticed since the code moved on (the full check runs the mutants; this only reads)."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation_run", REPO / "tests" / "mutations" / "run.py")
mutation_run = importlib.util.module_from_spec(_spec)
sys.modules["mutation_run"] = mutation_run  # dataclasses look their module up there
_spec.loader.exec_module(mutation_run)


@pytest.mark.parametrize("mutation", mutation_run.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_names_a_snippet_that_occurs_once_and_tests_that_exist(mutation):
    assert mutation_run.stale_reason(mutation) == "", mutation.name
