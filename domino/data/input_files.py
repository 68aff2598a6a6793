"""Input file formats: which names are read how, decompressing streams, and Parquet record batches.

=====================================  ==========================================================
name ends with                         read as
=====================================  ==========================================================
``.jsonl``, ``.json``                  JSON lines
``.txt``, ``.text``                    blank-line-separated text blocks
any of the above + ``.gz`` / ``.zst``  the same, decompressed as a stream (never to disk)
``.parquet``                           Parquet: the ``--json-keys`` name the text columns
=====================================  ==========================================================

Compressed files are read through :func:`open_lines`, which hands out the decompressed lines and how
many on-disk bytes have been consumed (for the progress bar). gzip streams go through the standard
library's ``gzip`` (multi-member files included); zstd through the ``zstandard`` package with
``read_across_frames=True``, so files of several concatenated frames (``pzstd``, ``zstd --long``
pipelines, appended shards) are read to the end, not just to the end of the first frame.

:func:`expand_inputs` turns the command line's paths, globs and directories into the files to read, each once:
symlinked folders are followed, every folder (by device and inode) entered once so a link loop ends, and a file
named twice (another path, a link) is read once, with one warning.

Parquet files are read with ``pyarrow.parquet.ParquetFile.iter_batches`` over the named columns only,
``PARQUET_BATCH_ROWS`` rows at a time, so memory stays bounded by a batch plus one row group's pages
of those columns, whatever the file size.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import logging
import os
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from domino.data.errors import DataError
from domino.data.limits import MAX_LINE_BYTES

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt", ".text")
PARQUET_SUFFIXES = (".parquet",)
#: Stream compressions: suffix -> name.
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
#: Rows per Parquet record batch handed to the tokenizer pipeline.
PARQUET_BATCH_ROWS = 1024
_READ_BUFFER = 1 << 20

#: Human description of the accepted names, for error messages.
SUPPORTED = ".jsonl/.json/.txt (optionally .gz or .zst) or .parquet"


def input_format(path: str) -> Optional[Tuple[str, Optional[str]]]:
    """``(kind, compression)`` of ``path`` from its name: kind ``jsonl``, ``text`` or ``parquet``; None if unsupported."""
    name = path.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet", None
    compression = None
    for suffix, codec in COMPRESSIONS.items():
        if name.endswith(suffix):
            name, compression = name[:-len(suffix)], codec
            break
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if name.endswith(TEXT_SUFFIXES):
        return "text", compression
    return None


def _directory_files(directory: str) -> List[str]:
    """Every supported file under ``directory`` (recursively, sorted; hidden files and folders skipped).

    Symlinked folders are followed (a corpus often links its current version in), each folder once
    (:func:`_folders`).
    """
    found, ignored = [], []
    for root, names in _folders(directory):
        for name in sorted(names):
            if name.startswith("."):
                continue
            (found if input_format(name) else ignored).append(os.path.join(root, name))
    if ignored:
        logger.warning("input directory %s: ignoring %d file(s) of unsupported type, e.g. %s", directory,
                       len(ignored), ", ".join(ignored[:3]))
    if not found:
        raise DataError(f"input directory {directory} holds no {SUPPORTED} file")
    return sorted(found)


def _folders(base: str) -> Iterator[Tuple[str, List[str]]]:
    """``(folder, its file names)`` of ``base`` and every folder below it, hidden ones skipped (as glob does),
    symlinked ones followed, and each folder, by its device and inode, once: a link loop ends there."""
    seen = set()
    for root, folders, names in os.walk(base, followlinks=True):
        identity = _identity(root)
        if identity in seen:
            folders[:] = []
            continue
        seen.add(identity)
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        yield root, names


def _glob(pattern: str) -> List[str]:
    """``glob.glob(pattern, recursive=True)`` without its walk: that follows symlinked folders with no memory of
    where it has been, so one link back up (``loop -> .``) names each file 40 times (until ELOOP) and two
    such links 2^40 times. Here a ``**`` walks each folder once (:func:`_folders`) and the rest of the pattern
    is matched in each of them."""
    head, magic, tail = pattern.partition("**")
    if not magic:
        return glob.glob(pattern)
    bases = glob.glob(head) if glob.has_magic(head) else [head]
    found: List[str] = []
    for base in (b for b in bases if os.path.isdir(b or os.curdir)):
        for folder, _ in _folders(base or os.curdir):
            rest = tail.lstrip("/" + os.sep)
            found += _glob(os.path.join(glob.escape(folder), rest)) if rest else [folder]
    return found


def _identity(path: str) -> Tuple[int, int]:
    """What a file is, whatever it is called: its device and inode (links and ``a/../a`` give the same)."""
    status = os.stat(path)
    return status.st_dev, status.st_ino


def expand_inputs(patterns: Sequence[str]) -> List[str]:
    """Files named by ``patterns`` (paths, globs or directories), in order, each file once.

    A glob's matches come in sorted order; a directory gives every supported file below it, sorted by
    path (unsupported files there are skipped with a warning). A file named again (by another path, a link,
    a glob that follows links) is read once, where it is first named, under the shortest of its names, with one
    warning listing the others.

    Raises:
        DataError: for a pattern that matches nothing or a named file of an unsupported type.
    """
    files: List[str] = []
    first: Dict[Tuple[int, int], int] = {}  # identity -> its place in files
    dropped: List[str] = []
    for pattern in patterns:
        matches = sorted(set(_glob(pattern))) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise DataError(f"input {pattern!r} matches no file")
        for match in matches:
            if os.path.isdir(match):
                paths = _directory_files(match)
            elif not os.path.isfile(match):
                raise DataError(f"input file not found: {match}")
            elif input_format(match) is None:
                raise DataError(f"input {match}: unsupported file type (expected {SUPPORTED})")
            else:
                paths = [match]
            for path in paths:
                identity = _identity(path)
                if identity not in first:
                    first[identity] = len(files)
                    files.append(path)
                    continue
                kept = files[first[identity]]
                if path == kept:  # the same name twice (a folder and a file in it): nothing to say
                    continue
                if len(path) < len(kept):  # a glob through a link loop may name it first by a long way round
                    files[first[identity]], path, kept = path, kept, path
                dropped.append(f"{path} (is {kept})")
    if dropped:
        logger.warning("input: %d file(s) named more than once are read once: %s", len(dropped),
                       ", ".join(dropped[:3]) + (", ..." if len(dropped) > 3 else ""))
    if not files:
        raise DataError("no input files given")
    return files


@contextlib.contextmanager
def open_lines(path: str, max_line_bytes: int = MAX_LINE_BYTES
               ) -> Iterator[Tuple[Iterator[Optional[bytes]], Callable[[], int]]]:
    """Opens a line-based input (plain or compressed) for reading, one bounded line at a time.

    Yields:
        ``(lines, consumed)``: an iterator over the decompressed lines (bytes, with their ``\\n``; None for a
        line longer than ``max_line_bytes``, whose rest is read through and dropped in bounded blocks) and a
        function returning how many bytes of the file on disk have been read so far.

    Raises:
        DataError: a compressed file that is corrupt or truncated, naming the file.
    """
    _, compression = input_format(path) or ("", None)
    with open(path, "rb", buffering=0 if compression else -1) as raw:
        if compression is None:
            yield _bounded(raw, max_line_bytes), raw.tell
            return
        if compression == "gzip":
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        else:
            import zstandard

            reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
            stream = io.BufferedReader(reader, buffer_size=_READ_BUFFER)
        with stream:
            yield _checked(_bounded(stream, max_line_bytes), path, compression), raw.tell


def _bounded(stream, limit: int) -> Iterator[Optional[bytes]]:
    """The lines of ``stream``, never holding more than ``limit`` + 1 bytes of one (None for a longer line)."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) <= limit:
            yield line
            continue
        while line and not line.endswith(b"\n"):  # read through the rest of the over-long line
            line = stream.readline(_READ_BUFFER)
        yield None


def _checked(stream: Iterator[Optional[bytes]], path: str, compression: str) -> Iterator[Optional[bytes]]:
    # Corrupt or truncated data surfaces while iterating (gzip: BadGzipFile/EOFError/zlib.error,
    # zstandard: ZstdError); name the file instead of passing on the codec's bare message.
    try:
        yield from stream
    except Exception as error:
        raise DataError(f"{path}: cannot decompress ({compression}): {error}") from None


def parquet_rows(path: str, keys: Sequence[str]) -> Iterator[Tuple[int, tuple, int]]:
    """Rows of the ``keys`` columns of a Parquet file, in file order, read in record batches.

    Yields:
        ``(row_number, values, nbytes)``: the 1-based row number, one value per key (``bytes``, a list of
        ``bytes`` or ``None``: the column's UTF-8 as stored, for :mod:`domino.data.text_inputs` to decode and
        name the row that is not UTF-8), and this row's share of the file size (for the progress bar).

    Raises:
        DataError: the file is not Parquet, lacks a column, or a column is not text, naming both.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path, buffer_size=_READ_BUFFER)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None
    with parquet:
        schema = parquet.schema_arrow
        for key in keys:
            if key not in schema.names:
                raise DataError(f"{path}: no column {key!r} (columns: {', '.join(schema.names[:10]) or 'none'})")
            kind = schema.field(key).type
            if pa.types.is_list(kind) or pa.types.is_large_list(kind):
                kind = kind.value_type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise DataError(f"{path}: column {key!r} has type {schema.field(key).type}, expected a string or "
                                "a list of strings")
        # Parquet does not enforce UTF-8 in string columns, and pyarrow's to_pylist raises a bare
        # UnicodeDecodeError for the whole batch on one bad value: read them as bytes (a view, no copy).
        as_bytes = {key: _binary_type(schema.field(key).type) for key in keys}
        total_rows = max(parquet.metadata.num_rows, 1)
        size = os.path.getsize(path)
        row, reported = 0, 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=list(keys)):
            columns = [batch.column(key).cast(as_bytes[key]).to_pylist() for key in keys]
            for values in zip(*columns):
                row += 1
                share = size * row // total_rows - reported
                reported += share
                yield row, values, share


def _binary_type(kind):
    """The binary type of the string (or list-of-string) type ``kind``, with the same offsets' width."""
    import pyarrow as pa

    if pa.types.is_list(kind):
        return pa.list_(_binary_type(kind.value_type))
    if pa.types.is_large_list(kind):
        return pa.large_list(_binary_type(kind.value_type))
    return pa.large_binary() if pa.types.is_large_string(kind) else pa.binary()
