"""Reading documents out of input files, with errors that name the file and the line (or row).

* ``.jsonl`` / ``.json``: one JSON object per line; each ``--json-keys`` key holds the document's text
  (a string, or a list of strings: Megatron's sentences, kept apart as a tuple). Blank lines are ignored.
* ``.txt``: a document is a block of lines separated by one or more blank lines (whitespace-only lines
  count as blank); the block's lines are joined with ``\\n``. With ``document_per_file`` the whole file
  is one document.
* either of them compressed (``.gz``, ``.zst``): the same, decompressed as a stream.
* ``.parquet``: one document per row; each key names a string (or list-of-strings) column.

:mod:`domino.data.input_files` knows the formats and finds the files; this module turns their lines and rows into
documents, so a row of a Parquet file and the same record as a JSON line give the same document.

Every problem (malformed JSON, a missing key, a value that is not text, bytes that are not UTF-8 in any
format, a JSON escape that leaves a lone surrogate, an input without documents) raises :class:`DataError` as ``file:line: what is wrong``, unless
``skip_bad_lines`` is set, in which case the line is dropped and counted in :class:`BadLineCounter`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from domino.data.errors import DataError
from domino.data.input_files import input_format, open_lines, parquet_rows
from domino.data.limits import MAX_LINE_BYTES

logger = logging.getLogger(__name__)


@dataclass
class Document:
    """One document: its text per key (a string, or a tuple of sentences), where it starts, its input bytes."""

    texts: Tuple[Union[str, Tuple[str, ...]], ...]
    source: str
    line: int
    nbytes: int


@dataclass
class BadLineCounter:
    """Lines dropped under ``skip_bad_lines``, with the first few reasons for the log."""

    count: int = 0
    examples: List[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(message)
        logger.debug("skipping bad input: %s", message)

    def log_summary(self) -> None:
        """One warning with the count and the first reasons, when anything was skipped."""
        if self.count:
            logger.warning("skipped %d bad input lines, e.g. %s", self.count, "; ".join(self.examples[:3]))


#: A UTF-16 surrogate: a Python string holds one alone only from a JSON ``\ud800`` escape without its pair (or, on
#: the command line, from a byte that is not UTF-8, which Python keeps as U+DC80..U+DCFF, PEP 383). It has no
#: UTF-8 encoding, so the tokenizer refuses the whole batch with a TypeError that names nothing.
_SURROGATE = re.compile("[\ud800-\udfff]")


def first_surrogate(text: str) -> Optional[int]:
    """Where ``text``'s first lone surrogate is (0-based), or None when the text is valid Unicode."""
    if text.isascii():  # O(1) in CPython (a flag of the string, Objects/unicodeobject.c): most text costs no scan
        return None
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


def _decode(raw: bytes, path: str, where: str) -> str:
    try:
        return raw.decode("utf-8")  # strict: surrogates encoded as UTF-8 (ED A0 80) are refused too
    except UnicodeDecodeError as error:
        bad = raw[error.start:error.start + 1]
        raise DataError(f"{path}:{where}: bytes are not valid UTF-8 (byte 0x{bad.hex()} at column "
                        f"{error.start + 1})") from None


def _text(value: Union[str, bytes], path: str, where: str, key: str) -> str:
    if isinstance(value, bytes):  # a Parquet string column, as stored
        return _decode(value, path, f"{where}, column {key!r}")
    at = first_surrogate(value)
    if at is not None:
        raise DataError(f"{path}:{where}: key {key!r} holds a lone surrogate U+{ord(value[at]):04X} at character "
                        f"{at + 1} (a \\u{ord(value[at]):04x} escape without its pair), which is not Unicode text")
    return value


def _check_value(value, path: str, where: str, key: str) -> Union[str, Tuple[str, ...]]:
    if isinstance(value, list) and all(isinstance(v, (str, bytes)) for v in value):
        return tuple(_text(v, path, where, key) for v in value)  # Megatron's sentence list: one sequence each
    if not isinstance(value, (str, bytes)):
        kind = "null" if value is None else type(value).__name__
        raise DataError(f"{path}:{where}: key {key!r} holds {kind}, expected a string or a list of strings")
    return _text(value, path, where, key)


def _json_texts(line: str, path: str, line_number: int, keys: Sequence[str]) -> Tuple[str, ...]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{line_number}: malformed JSON ({error.msg} at column {error.colno})") from None
    except (ValueError, RecursionError) as error:  # an integer of over 4300 digits, nesting deeper than ~1000
        raise DataError(f"{path}:{line_number}: unreadable JSON ({type(error).__name__}: "
                        f"{' '.join(str(error).split())[:100]})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}")
    texts = []
    for key in keys:
        if key not in record:
            present = ", ".join(sorted(record)[:10]) or "none"
            raise DataError(f"{path}:{line_number}: missing key {key!r} (keys present: {present})")
        texts.append(_check_value(record[key], path, str(line_number), key))
    return tuple(texts)


def _too_long(path: str, line_number: int, limit: int) -> DataError:
    return DataError(f"{path}:{line_number}: line longer than {limit:,} bytes (--max-line-bytes); a JSON-lines "
                     "file holds one document per line")


def read_jsonl(path: str, keys: Sequence[str], bad: BadLineCounter, skip_bad_lines: bool,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Document]:
    """Documents of a JSON-lines file, plain or compressed (one per non-blank line)."""
    with open_lines(path, max_line_bytes) as (lines, consumed):
        reported = 0
        for line_number, raw in enumerate(lines, start=1):
            if raw is not None and not raw.strip():
                continue
            try:
                if raw is None:
                    raise _too_long(path, line_number, max_line_bytes)
                texts = _json_texts(_decode(raw, path, str(line_number)), path, line_number, keys)
            except DataError as error:
                if not skip_bad_lines:
                    raise
                bad.add(str(error))
                continue
            position = consumed()
            yield Document(texts, path, line_number, position - reported)
            reported = position


def read_text(path: str, document_per_file: bool, bad: BadLineCounter, skip_bad_lines: bool,
              max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Document]:
    """Documents of a plain-text file, plain or compressed: blank-line-separated blocks, or the whole file."""
    block: List[str] = []
    start, reported = 0, 0
    with open_lines(path, max_line_bytes) as (lines, consumed):
        for line_number, raw in enumerate(lines, start=1):
            try:
                if raw is None:
                    raise _too_long(path, line_number, max_line_bytes)
                line = _decode(raw, path, str(line_number))
            except DataError as error:
                if not skip_bad_lines:
                    raise
                bad.add(str(error))
                continue
            if not document_per_file and not line.strip():
                if block:
                    position = consumed()
                    yield Document(("\n".join(block),), path, start, position - reported)
                    block, reported = [], position
                continue
            if not block:
                start = line_number
            block.append(line.rstrip("\r\n") if not document_per_file else line)
        if block:
            text = "".join(block) if document_per_file else "\n".join(block)
            yield Document((text,), path, start, consumed() - reported)


def read_parquet(path: str, keys: Sequence[str], bad: BadLineCounter, skip_bad_lines: bool) -> Iterator[Document]:
    """Documents of a Parquet file: one per row, the texts from the ``keys`` columns."""
    for row, values, nbytes in parquet_rows(path, keys):
        try:
            texts = tuple(_check_value(value, path, f"row {row}", key) for key, value in zip(keys, values))
        except DataError as error:
            if not skip_bad_lines:
                raise
            bad.add(str(error))
            continue
        yield Document(texts, path, row, nbytes)


def _reader(path: str, keys: Sequence[str], document_per_file: bool, bad: BadLineCounter,
            skip_bad_lines: bool, max_line_bytes: int) -> Iterable[Document]:
    kind, _ = input_format(path) or ("", None)
    if kind == "jsonl":
        return read_jsonl(path, keys, bad, skip_bad_lines, max_line_bytes)
    if kind == "parquet":
        return read_parquet(path, keys, bad, skip_bad_lines)
    if len(keys) != 1:
        raise DataError(f"input {path}: a .txt file has one text per document; give a single --json-keys "
                        f"name for it (got {', '.join(keys)})")
    return read_text(path, document_per_file, bad, skip_bad_lines, max_line_bytes)


def read_documents(files: Sequence[str], keys: Sequence[str], document_per_file: bool = False,
                   skip_bad_lines: bool = False, bad: BadLineCounter = None,
                   max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Document]:
    """Documents of every file in order; a file that yields none is an error (a warning when skipping).

    Each document's ``nbytes`` is its share of the file on disk (compressed bytes for compressed files),
    so that over a file they add up to its size.

    Raises:
        DataError: ``file:line: reason`` for the first bad line (unless ``skip_bad_lines``).
    """
    bad = bad if bad is not None else BadLineCounter()
    for path in files:
        held, counted = None, 0
        for document in _reader(path, keys, document_per_file, bad, skip_bad_lines, max_line_bytes):
            if held is not None:
                yield held
            held, counted = document, counted + document.nbytes
        if held is None:
            message = f"input {path} holds no documents (empty file?)"
            if not skip_bad_lines:
                raise DataError(message)
            bad.add(message)
            continue
        held.nbytes += os.path.getsize(path) - counted  # the file's tail after the last document
        yield held


def input_bytes(files: Sequence[str]) -> int:
    """Total size of ``files`` in bytes (for the progress bar)."""
    return sum(os.path.getsize(path) for path in files)
