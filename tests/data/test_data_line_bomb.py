"""A one-line ``.jsonl.gz`` bomb: a clear error naming the file and line, in bounded memory, never an OOM.

Real files and a real ``domino preprocess`` process; its peak memory (ru_maxrss of the child) is read by
the kernel's accounting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

from domino.data.indexed_dataset import IndexedDataset

ROOT = Path(__file__).resolve().parents[2]
LINE = 400 << 20  # one 400 MiB line: six times the default --max-line-bytes


def _bomb(path: Path, good_after: bool = False) -> None:
    """``{"text": "aaaa...`` on one line, written compressed in blocks (a few hundred KB on disk)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    with open(path, "wb") as out:
        out.write(compressor.compress(b'{"text": "'))
        block = b"a" * (1 << 20)
        for _ in range(LINE >> 20):
            out.write(compressor.compress(block))
        out.write(compressor.compress(b'"}\n'))
        if good_after:
            out.write(compressor.compress(json.dumps({"text": "a small document after the bomb"}).encode() + b"\n"))
        out.write(compressor.flush())


# Runs one command and reports the peak RSS of that child alone (ru_maxrss of a fresh parent's children).
MEASURED = """
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=500)  # kills its child on timeout
print(json.dumps({"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                  "peak_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def _preprocess(*args: str) -> tuple:
    """Runs ``domino preprocess`` in a child; returns (its result as a dict, its peak RSS in MiB)."""
    proc = subprocess.run([sys.executable, "-c", MEASURED, sys.executable, "-m", "domino", "preprocess", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    result = json.loads(proc.stdout)
    return result, result["peak_kib"] / 1024


def test_a_one_line_gzip_bomb_is_a_clear_error_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.jsonl.gz"
    _bomb(bomb)
    assert bomb.stat().st_size < (4 << 20)
    result, peak_mib = _preprocess("--input", str(bomb), "--output-prefix", str(tmp_path / "out"))
    assert result["rc"] == 2, result["stderr"]
    assert f"{bomb}:1: line longer than 67,108,864 bytes (--max-line-bytes)" in result["stderr"]
    assert "Traceback" not in result["stderr"]
    # The line is 400 MiB; holding it (let alone decoding and parsing it) would need several times that.
    assert peak_mib < 400, peak_mib
    assert not list(tmp_path.glob("out*"))


def test_with_skip_bad_lines_the_bomb_is_read_through_and_counted(tmp_path):
    bomb = tmp_path / "bomb.jsonl.gz"
    _bomb(bomb, good_after=True)
    result, peak_mib = _preprocess("--input", str(bomb), "--output-prefix", str(tmp_path / "out"),
                                   "--skip-bad-lines", "--max-line-bytes", "1000000")
    assert result["rc"] == 0, result["stderr"]
    assert "1 bad lines skipped" in result["stdout"]
    assert IndexedDataset(str(tmp_path / "out_text_document")).num_documents == 1
    assert peak_mib < 400, peak_mib
