"""Reading documents out of ``.jsonl`` and ``.txt`` files, with errors that name the file and the line.

* ``.jsonl`` / ``.json``: one JSON object per line; each ``--json-keys`` key holds the document's text
  (a string, or a list of strings: Megatron's sentences, kept apart as a tuple). Blank lines are ignored.
* ``.txt``: a document is a block of lines separated by one or more blank lines (whitespace-only lines
  count as blank); the block's lines are joined with ``\\n``. With ``document_per_file`` the whole file
  is one document.

Every problem (malformed JSON, a missing key, a value that is not text, bytes that are not UTF-8, an
input without documents) raises :class:`DataError` as ``file:line: what is wrong``, unless
``skip_bad_lines`` is set, in which case the line is dropped and counted in :class:`BadLineCounter`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Iterator, List, Sequence, Tuple, Union

from domino.data.errors import DataError

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt", ".text")


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


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Files named by ``patterns`` (paths or globs), in order, without duplicates.

    Raises:
        DataError: for a pattern that matches nothing or a file of an unsupported type.
    """
    files: List[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if not os.path.isdir(m)]
        if not matches:
            raise DataError(f"input {pattern!r} matches no file")
        for path in matches:
            if not os.path.isfile(path):
                raise DataError(f"input file not found: {path}")
            if not path.endswith(JSONL_SUFFIXES + TEXT_SUFFIXES):
                raise DataError(f"input {path}: unsupported file type (expected .jsonl, .json or .txt)")
            if path not in files:
                files.append(path)
    if not files:
        raise DataError("no input files given")
    return files


def _decode(raw: bytes, path: str, line_number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = raw[error.start:error.start + 1]
        raise DataError(f"{path}:{line_number}: bytes are not valid UTF-8 (byte 0x{bad.hex()} at column "
                        f"{error.start + 1})") from None


def _json_texts(line: str, path: str, line_number: int, keys: Sequence[str]) -> Tuple[str, ...]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{line_number}: malformed JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}")
    texts = []
    for key in keys:
        if key not in record:
            present = ", ".join(sorted(record)[:10]) or "none"
            raise DataError(f"{path}:{line_number}: missing key {key!r} (keys present: {present})")
        value = record[key]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = tuple(value)  # Megatron's sentence list: one sequence per sentence
        if not isinstance(value, (str, tuple)):
            raise DataError(f"{path}:{line_number}: key {key!r} holds {type(value).__name__}, expected a string "
                           "or a list of strings")
        texts.append(value)
    return tuple(texts)


def read_jsonl(path: str, keys: Sequence[str], bad: BadLineCounter, skip_bad_lines: bool) -> Iterator[Document]:
    """Documents of a JSON-lines file (one per non-blank line)."""
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                texts = _json_texts(_decode(raw, path, line_number), path, line_number, keys)
            except DataError as error:
                if not skip_bad_lines:
                    raise
                bad.add(str(error))
                continue
            yield Document(texts, path, line_number, len(raw))


def read_text(path: str, document_per_file: bool, bad: BadLineCounter, skip_bad_lines: bool) -> Iterator[Document]:
    """Documents of a plain-text file: blank-line-separated blocks, or the whole file."""
    block: List[str] = []
    start, nbytes = 0, 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            nbytes += len(raw)
            try:
                line = _decode(raw, path, line_number)
            except DataError as error:
                if not skip_bad_lines:
                    raise
                bad.add(str(error))
                continue
            if not document_per_file and not line.strip():
                if block:
                    yield Document(("\n".join(block),), path, start, nbytes)
                    block, nbytes = [], 0
                continue
            if not block:
                start = line_number
            block.append(line.rstrip("\r\n") if not document_per_file else line)
    if block:
        text = "".join(block) if document_per_file else "\n".join(block)
        yield Document((text,), path, start, nbytes)


def read_documents(files: Sequence[str], keys: Sequence[str], document_per_file: bool = False,
                   skip_bad_lines: bool = False, bad: BadLineCounter = None) -> Iterator[Document]:
    """Documents of every file in order; a file that yields none is an error (a warning when skipping).

    Raises:
        DataError: ``file:line: reason`` for the first bad line (unless ``skip_bad_lines``).
    """
    bad = bad if bad is not None else BadLineCounter()
    for path in files:
        if path.endswith(JSONL_SUFFIXES):
            documents = read_jsonl(path, keys, bad, skip_bad_lines)
        else:
            if len(keys) != 1:
                raise DataError(f"input {path}: a .txt file has one text per document; give a single --json-keys "
                                f"name for it (got {', '.join(keys)})")
            documents = read_text(path, document_per_file, bad, skip_bad_lines)
        found = 0
        for document in documents:
            found += 1
            yield document
        if found == 0:
            message = f"input {path} holds no documents (empty file?)"
            if not skip_bad_lines:
                raise DataError(message)
            bad.add(message)


def input_bytes(files: Sequence[str]) -> int:
    """Total size of ``files`` in bytes (for the progress bar)."""
    return sum(os.path.getsize(path) for path in files)
