"""``domino report --eval-json`` with a malformed file: one clear error naming the file, before any work."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "entry '1' is a int, expected an object"),
    ('{"test": 5}', "entry 'test' is a int, expected an object"),
    ('{"loss": "x", "ppl": 3.0}', "entry 'evaluation' has loss='x', expected a number"),
    ('"text"', "expected an evaluation result"),
    ("{not json", "is not valid JSON"),
])
def test_a_malformed_eval_json_is_one_clear_error(tmp_path, content, message):
    source = tmp_path / "eval.json"
    source.write_text(content)
    out = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "domino", "report", "--eval-json", str(source), "--output", str(out)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = {line.split("error: ", 1)[-1].split("ERROR domino: ", 1)[-1] for line in proc.stderr.splitlines()}
    (error,) = errors  # one message (however many times the CLI prints it)
    assert error.startswith(f"--eval-json {source}") and message in error
    assert not out.exists()
