"""Megatron's ``MMIDIDX`` indexed dataset: a ``.bin`` of raw token ids plus an ``.idx`` describing them.

The layout (see ``docs/data.md``) is byte-for-byte the one Megatron-LM's ``preprocess_data.py`` writes
and its ``MMapIndexedDataset`` reads, so datasets move freely between the two projects.

* :class:`IndexedDatasetWriter` streams sequences to a ``.bin`` under a temporary name and, on
  :meth:`~IndexedDatasetWriter.finalize`, writes the ``.idx`` and renames both into place (fsynced).
* :class:`IndexedDataset` memory-maps an existing pair after validating every header field and the
  ``.bin`` size against the pointers, so a truncated or corrupt file is a :class:`DataError` naming
  the file and the field, never a crash or a hang.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from typing import BinaryIO, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from domino.atomic_files import commit, fsync_directory, open_owned_temporary, remove_quietly
from domino.data.errors import DataError
from domino.data.index_checks import validate_index_arrays

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # magic (9) + version (8) + dtype code (1) + sequence count (8) + document-index length (8)

#: dtype code in the ``.idx`` header -> numpy dtype of the tokens in ``.bin``.
DTYPES: Dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice of token dtype (``DType.optimal_dtype``, megatron/core/datasets/indexed_dataset.py,
    core_r0.11.0): uint16 when ``vocab_size`` (the highest id + 1, :attr:`Tokenizer.vocab_size`) is below 65500,
    so every id fits, else int32."""
    return np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)


def data_file_path(prefix: str) -> str:
    """``{prefix}.bin``."""
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    """``{prefix}.idx``."""
    return prefix + ".idx"


def index_header(dtype: np.dtype, count: int, document_index_length: int) -> bytes:
    """The 34-byte ``.idx`` header: magic, version, dtype code, sequence count, document-index length."""
    return (MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", _CODES[np.dtype(dtype)])
            + struct.pack("<QQ", count, document_index_length))


def commit_dataset(bin_temp: str, idx_temp: str, prefix: str, synced: bool = False) -> None:
    """Moves a finished ``.bin``/``.idx`` pair from temporary names to ``prefix`` (``.bin`` first).

    Args:
        bin_temp: The temporary ``.bin``.
        idx_temp: The temporary ``.idx``.
        prefix: The final prefix.
        synced: The caller fsynced both temporaries through the handles it still holds open (and owns:
            see :func:`domino.atomic_files.open_owned_temporary`); else each is fsynced here.

    Replacing a prefix that other processes read is not atomic for the pair: use a new prefix for each
    build and publish it (:mod:`domino.data.dataset_store`) where readers share a dataset.
    """
    # Drop an old .idx first: between the two renames there is a new .bin and no .idx, never a
    # new .bin beside a stale .idx that might still look valid.
    remove_quietly(index_file_path(prefix))
    if synced:
        os.replace(bin_temp, data_file_path(prefix))
        os.replace(idx_temp, index_file_path(prefix))
    else:
        commit(bin_temp, data_file_path(prefix))
        commit(idx_temp, index_file_path(prefix))
    fsync_directory(os.path.dirname(os.path.abspath(prefix)))


def temporary_paths(prefix: str) -> List[str]:
    """The final names whose temporaries a writer of ``prefix`` creates (for :func:`sweep_temporaries`)."""
    return [data_file_path(prefix), index_file_path(prefix)]


def write_index(target: Union[str, BinaryIO], dtype: np.dtype, sizes: np.ndarray, document_index: np.ndarray) -> None:
    """Writes an ``.idx`` (to a path, or an open binary file; not atomically: callers write to a temporary)."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    document_index = np.asarray(document_index, dtype=np.int64)
    with (open(target, "wb") if isinstance(target, str) else contextlib.nullcontext(target)) as handle:
        handle.write(index_header(dtype, len(sizes), len(document_index)))
        handle.write(sizes.astype("<i4").tobytes(order="C"))
        handle.write(pointers.astype("<i8").tobytes(order="C"))
        handle.write(document_index.astype("<i8").tobytes(order="C"))


class IndexedDatasetWriter:
    """Streams documents into ``{prefix}.bin`` / ``{prefix}.idx``, atomically.

    ``sequences`` and ``tokens`` count what was added so far. Nothing appears under the final names until
    :meth:`finalize`; :meth:`abort` (or an exception inside
    a ``with`` block) deletes the temporary files.

    Example::

        with IndexedDatasetWriter("out/corpus_text_document", np.uint16) as writer:
            writer.add_document(np.array([1, 2, 3]))
        # finalize() ran on leaving the block
    """

    def __init__(self, prefix: str, dtype: Union[np.dtype, type]) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise DataError(f"{prefix}: unsupported token dtype {self.dtype} (supported: {sorted(map(str, _CODES))})")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        # Owned (record-locked) until renamed, so that only a dead writer's temporaries are ever swept.
        self._bin_temp, self._bin = open_owned_temporary(data_file_path(prefix))
        self._idx_temp, self._idx = "", None
        self._sizes: List[np.ndarray] = []
        self._document_ends: List[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self.sequences = 0
        self.tokens = 0

    def add_document(self, tokens: np.ndarray, sequence_lengths: Optional[Sequence[int]] = None) -> None:
        """Appends one document (by default one sequence; ``sequence_lengths`` splits it into several)."""
        tokens = np.asarray(tokens)
        lengths = np.asarray([len(tokens)] if sequence_lengths is None else sequence_lengths, dtype=np.int64)
        self.add_documents(tokens, lengths, np.asarray([len(lengths)], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray,
                      sequences_per_document: Optional[np.ndarray] = None) -> None:
        """Appends many sequences at once: ``tokens`` is their concatenation (vectorised fast path).

        Args:
            tokens: all token ids, concatenated.
            sequence_lengths: length of each sequence; they must sum to ``len(tokens)``.
            sequences_per_document: how many consecutive sequences make each document (default: one each).
        """
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64)
        if int(sequence_lengths.sum()) != len(tokens):
            raise ValueError(f"sequence lengths sum to {int(sequence_lengths.sum())}, but {len(tokens)} tokens given")
        if len(sequence_lengths) and (sequence_lengths.min() < 0 or sequence_lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("sequence lengths must be in [0, 2**31)")
        if sequences_per_document is None:
            sequences_per_document = np.ones(len(sequence_lengths), dtype=np.int64)
        converted = np.asarray(tokens).astype(self.dtype, copy=False)
        if converted.dtype.kind in "iu" and len(tokens) and not np.array_equal(converted, tokens):
            raise ValueError(f"token ids do not fit the dataset dtype {self.dtype}")
        self._bin.write(np.ascontiguousarray(converted).tobytes(order="C"))
        self._sizes.append(sequence_lengths.astype(np.int32))
        self._document_ends.append(self.sequences + np.cumsum(np.asarray(sequences_per_document, dtype=np.int64)))
        self.sequences += len(sequence_lengths)
        self.tokens += len(tokens)

    def finalize(self) -> None:
        """Writes the ``.idx`` and moves both files to their final names (``.bin`` first, each fsynced)."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        self._idx_temp, self._idx = open_owned_temporary(index_file_path(self.prefix))
        write_index(self._idx, self.dtype, sizes, np.concatenate(self._document_ends))
        self._idx.flush()
        os.fsync(self._idx.fileno())
        commit_dataset(self._bin_temp, self._idx_temp, self.prefix, synced=True)  # renamed while still owned
        self._close()

    def _close(self) -> None:
        for handle in (self._bin, self._idx):
            if handle is not None and not handle.closed:
                handle.close()

    def abort(self) -> None:
        """Closes and deletes the temporary files; the final names are left untouched."""
        self._close()
        remove_quietly(self._bin_temp)
        if self._idx_temp:
            remove_quietly(self._idx_temp)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def read_index(path: str, bin_size: Optional[int] = None) -> dict:
    """Parses and validates an ``.idx`` file; returns its fields as numpy arrays (memory-mapped).

    Args:
        path: the ``.idx`` file.
        bin_size: size in bytes of the matching ``.bin``; when given, the pointers are checked against it.

    Raises:
        DataError: naming ``path`` and the field for every inconsistency.
    """
    try:
        file_size = os.path.getsize(path)
    except OSError as error:
        raise DataError(f"{path}: cannot open index file: {error.strerror}") from error
    if file_size < HEADER_SIZE:
        raise DataError(f"{path}: truncated header ({file_size} bytes, need {HEADER_SIZE})")
    with open(path, "rb") as handle:
        header = handle.read(HEADER_SIZE)
    if header[:9] != MAGIC:
        raise DataError(f"{path}: bad magic {header[:9]!r} (expected {MAGIC!r}; not a Megatron MMIDIDX index)")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != VERSION:
        raise DataError(f"{path}: unsupported version {version} (expected {VERSION})")
    code = header[17]
    if code not in DTYPES:
        raise DataError(f"{path}: unknown dtype code {code} (expected one of {sorted(DTYPES)})")
    count, doc_count = struct.unpack("<QQ", header[18:34])
    expected = HEADER_SIZE + 12 * count + 8 * doc_count
    if file_size not in (expected, expected + count):  # the optional int8 modes of multimodal files
        raise DataError(f"{path}: file size {file_size} does not match the header's sequence count {count} and "
                        f"document-index length {doc_count} (expected {expected} bytes)")
    if doc_count < 1:
        raise DataError(f"{path}: document-index length is 0 (it always holds at least the leading 0)")
    buffer = np.memmap(path, mode="r", dtype=np.uint8) if file_size else np.zeros(0, np.uint8)
    sizes = np.frombuffer(buffer, dtype="<i4", count=count, offset=HEADER_SIZE)
    pointers = np.frombuffer(buffer, dtype="<i8", count=count, offset=HEADER_SIZE + 4 * count)
    document_index = np.frombuffer(buffer, dtype="<i8", count=doc_count, offset=HEADER_SIZE + 12 * count)
    dtype = DTYPES[code]
    validate_index_arrays(path, dtype, sizes, pointers, document_index, bin_size)
    return {"dtype": dtype, "sizes": sizes, "pointers": pointers, "document_index": document_index}


class IndexedDataset:
    """Read-only, memory-mapped view of a ``{prefix}.bin`` / ``{prefix}.idx`` pair.

    ``len(ds)`` is the number of sequences; ``ds[i]`` is sequence ``i`` as a numpy array of the file's
    dtype (a view into the mapping, no copy); ``ds.get(i, offset, length)`` a part of it;
    ``ds.get_document(d)`` all sequences of document ``d``. Attributes: ``sizes`` (int32 length per
    sequence), ``document_index`` (int64, ``num_documents + 1`` entries), ``dtype``, ``num_tokens``.

    Args:
        prefix: path without the ``.bin``/``.idx`` suffix.
        mmap_warmup: read every page of both files once up front (useful on network file systems).

    Raises:
        DataError: when a file is missing, truncated or inconsistent (message names file and field).
    """

    def __init__(self, prefix: str, mmap_warmup: bool = False) -> None:
        self.prefix = prefix
        bin_path = data_file_path(prefix)
        try:
            bin_size = os.path.getsize(bin_path)
        except OSError as error:
            raise DataError(f"{bin_path}: cannot open data file: {error.strerror}") from error
        fields = read_index(index_file_path(prefix), bin_size)
        self.dtype: np.dtype = fields["dtype"]
        self.sizes: np.ndarray = fields["sizes"]
        self.pointers: np.ndarray = fields["pointers"]
        self.document_index: np.ndarray = fields["document_index"]
        self.num_tokens = bin_size // self.dtype.itemsize
        if mmap_warmup:
            warmup(index_file_path(prefix))
            warmup(bin_path)
        # Our own mmap object (not np.memmap) so that release_memory() can madvise it; an empty file
        # cannot be mapped, so an empty dataset gets an empty array instead.
        self._mmap: Optional[mmap.mmap] = None
        self._tokens = np.zeros(0, dtype=self.dtype)
        if bin_size:
            with open(bin_path, "rb") as handle:
                self._mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            self._tokens = np.frombuffer(self._mmap, dtype=self.dtype, count=self.num_tokens)

    def __getstate__(self) -> dict:
        # Pickled (e.g. for spawned DataLoader workers) by path, never by copying the mapped files.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(document_index) - 1``)."""
        return len(self.document_index) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (to its end when ``length`` is None)."""
        size = int(self.sizes[index])
        if not 0 <= offset <= size:
            raise IndexError(f"offset {offset} outside sequence {index} of length {size}")
        length = size - offset if length is None else length
        if length < 0 or offset + length > size:
            raise IndexError(f"length {length} from offset {offset} overruns sequence {index} of length {size}")
        start = int(self.pointers[index]) // self.dtype.itemsize + offset
        return self._tokens[start:start + length]

    def get_document(self, document: int) -> np.ndarray:
        """All tokens of document ``document`` (its sequences, concatenated)."""
        if not 0 <= document < self.num_documents:
            raise IndexError(f"document {document} outside [0, {self.num_documents})")
        first, last = int(self.document_index[document]), int(self.document_index[document + 1])
        if first == last:
            return self._tokens[0:0]
        start = int(self.pointers[first]) // self.dtype.itemsize
        end = int(self.pointers[last - 1]) // self.dtype.itemsize + int(self.sizes[last - 1])
        return self._tokens[start:end]


    def first_token_outside(self, vocab_size: int, block_tokens: int) -> Optional[tuple]:
        """``(position, token id)`` of the first token id outside ``[0, vocab_size)``, or None.

        Reads ``.bin`` ``block_tokens`` at a time and releases the pages read, so memory stays flat.
        """
        for start in range(0, self.num_tokens, block_tokens):
            block = self._tokens[start:start + block_tokens]
            bad = (block >= vocab_size) | (block < 0) if self.dtype.kind in "if" else block >= vocab_size
            if bad.any():
                position = start + int(np.argmax(bad))
                return position, self._tokens[position].item()
            self.release_memory()
        return None

    def release_memory(self) -> None:
        """Drops this process's mapped pages of ``.bin`` (they stay in the page cache; reads refault them).

        Resident pages of a file mapping count in a process's RSS although the kernel can reclaim them;
        a long sequential pass can call this to keep RSS near its working set.
        """
        if self._mmap is not None and hasattr(self._mmap, "madvise"):
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def iter_documents(self, release_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
        """Every document in order, releasing the pages already read every ``release_bytes`` bytes.

        The RSS of a process that reads a whole dataset this way stays near ``release_bytes`` instead of
        growing to the file size. The arrays yielded stay valid (released pages are read again on access).
        """
        since_release = 0
        for document in range(self.num_documents):
            tokens = self.get_document(document)
            since_release += tokens.nbytes
            yield tokens
            if since_release >= release_bytes:
                self.release_memory()
                since_release = 0


def warmup(path: str, chunk_bytes: int = 100 * 1024 * 1024) -> None:
    """Reads ``path`` once, sequentially, so later random access hits the page cache (Megatron's mmap warmup)."""
    with open(path, "rb") as handle:
        while handle.read(chunk_bytes):
            pass
