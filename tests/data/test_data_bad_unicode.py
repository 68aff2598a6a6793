"""Text that is not Unicode, in every input format and on the command line: a ``file:line`` error (or the
flag's), or with ``--skip-bad-lines`` a skipped, counted document; never the tokenizer's bare TypeError.

Two ways in: bytes that are not UTF-8 (a ``.txt``, a Parquet string column, which Parquet does not check), and
a JSON ``\\ud800`` escape without its pair, which ``json.loads`` turns into a lone surrogate that has no UTF-8.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from domino.data.errors import DataError
from domino.data.preprocess import preprocess
from domino.data.tokenizer_training import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
GOOD = ["first good document", "second good document"]


def _jsonl(path: Path, texts) -> None:
    # ensure_ascii writes a lone surrogate as the escape \ud800, as a hostile file holds it
    data = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


def _txt_zst(path: Path, texts) -> None:
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress(b"\n\n".join(texts) + b"\n"))


def _parquet(path: Path, texts, as_list: bool = False) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A view skips pyarrow's UTF-8 check, so the file holds what another writer may have put there.
    column = pa.array(texts, type=pa.binary()).view(pa.string())
    if as_list:
        column = pa.ListArray.from_arrays(pa.array(range(len(texts) + 1), type=pa.int32()), column)
    pq.write_table(pa.table({"text": column}), str(path))


CASES = {
    "jsonl-surrogate": ("in.jsonl", lambda p: _jsonl(p, [GOOD[0], "bad \ud800 text", GOOD[1]]),
                        r"in.jsonl:2: key 'text' holds a lone surrogate U\+D800 at character 5 \(a \\ud800 escape"),
    "jsonl.gz-surrogate-in-a-sentence": ("in.jsonl.gz", lambda p: _jsonl(p, [GOOD[0], GOOD[1], ["ok", "x\udfff"]]),
                                         r"in.jsonl.gz:3: key 'text' holds a lone surrogate U\+DFFF at character 2"),
    "txt.zst-not-utf8": ("in.txt.zst", lambda p: _txt_zst(p, [GOOD[0].encode(), b"caf\xe9 au lait", GOOD[1].encode()]),
                         r"in.txt.zst:3: bytes are not valid UTF-8 \(byte 0xe9 at column 4\)"),
    "parquet-not-utf8": ("in.parquet", lambda p: _parquet(p, [GOOD[0].encode(), b"caf\xe9", GOOD[1].encode()]),
                         r"in.parquet:row 2, column 'text': bytes are not valid UTF-8 \(byte 0xe9 at column 4\)"),
    "parquet-list-not-utf8": ("in.parquet", lambda p: _parquet(p, [b"\xff", GOOD[0].encode(), GOOD[1].encode()], True),
                              r"in.parquet:row 1, column 'text': bytes are not valid UTF-8 \(byte 0xff at column 1\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_text_that_is_not_unicode_is_one_error_or_one_skipped_document(tmp_path, case):
    name, write, message = CASES[case]
    source = tmp_path / name
    write(source)
    with pytest.raises(DataError, match=message):
        preprocess([str(source)], str(tmp_path / "strict"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written
    result = preprocess([str(source)], str(tmp_path / "d"), skip_bad_lines=True)
    assert (result.documents, result.skipped_lines) == (2, 1)
    with pytest.raises(DataError, match=message):
        train_tokenizer([str(source)], 257, str(tmp_path / "tok-strict"))
    assert not (tmp_path / "tok-strict").exists()
    assert train_tokenizer([str(source)], 257, str(tmp_path / "tok"), skip_bad_lines=True).vocab_size == 257


def _domino(*argv, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "domino", *argv], cwd=cwd, capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _one_error(proc: subprocess.CompletedProcess) -> str:
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr
    (error,) = {line.split("error: ", 1)[-1] for line in stderr.splitlines() if "error" in line.lower()}
    return error


def test_the_commands_name_the_line_skip_and_count_it_and_refuse_a_prompt_that_is_not_utf8(tmp_path):
    _jsonl(tmp_path / "in.jsonl", [GOOD[0], "bad \ud800", GOOD[1]])
    error = _one_error(_domino("preprocess", "--input", "in.jsonl", "--output-prefix", "d", cwd=tmp_path))
    assert error.startswith("in.jsonl:2: key 'text' holds a lone surrogate U+D800")
    done = _domino("train-tokenizer", "--input", "in.jsonl", "--vocab-size", "257", "--output", "tok",
                   "--skip-bad-lines", cwd=tmp_path)
    assert done.returncode == 0 and b"skipped 1 bad input lines, e.g. in.jsonl:2:" in done.stderr, done.stderr
    # argv bytes that are not UTF-8; --load names nothing, so the prompt is refused before any loading
    for argv in (["generate", "--load", "missing", "--prompt", b"caf\xe9"],
                 ["report", "--output", "r.html", "--sample-prompt", b"ok", "--sample-prompt", b"\xff"]):
        error = _one_error(_domino(*argv, cwd=tmp_path))
        assert error.startswith(f"argument {argv[-2]}: not valid UTF-8 text (byte 0x"), error
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "tok"]
