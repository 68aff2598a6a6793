"""``domino merge-datasets``: concatenate indexed datasets into one, streaming, atomically.

Megatron-LM's ``tools/merge_datasets.py`` (NVIDIA/Megatron-LM, commit 00caa53) takes every prefix in a
directory in sorted order and calls ``IndexedDatasetBuilder.add_index`` for each
(``megatron/core/datasets/indexed_dataset.py``): it asserts the dtypes agree, appends the sequence
lengths, appends ``offset + document_indices[1:]`` to the document index and copies ``.bin`` with
``shutil.copyfileobj``. The result is the ``.bin``/``.idx`` that preprocessing all inputs in that order
in one run writes. This module writes the same bytes, with three differences:

* **flat memory**: Megatron holds every input's lengths and document index in Python lists until
  ``finalize``; here the header is written first (the totals come from the inputs' headers) and each
  ``.idx`` section is streamed input by input in blocks of :data:`BLOCK_ITEMS`, so memory does not grow
  with the dataset;
* **checks before any work**: every input is validated (as :class:`IndexedDataset` does), dtypes must
  agree, and the tokenizers recorded in the ``.meta.json`` sidecars must agree (:mod:`provenance`);
* **atomic**: both files are written under temporary names and renamed at the end (``atomic_files``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import BinaryIO, List, Optional, Sequence

import numpy as np

from domino.atomic_files import open_owned_temporary, remove_quietly, sweep_temporaries
from domino.data.errors import DataError
from domino.data.indexed_dataset import (HEADER_SIZE, commit_dataset, data_file_path, index_file_path,
                                         index_header, read_index, temporary_paths)
from domino.data.provenance import (DatasetMeta, check_output_name, check_same_tokenizer, meta_path, read_meta,
                                   write_meta)

logger = logging.getLogger(__name__)

#: Index entries read and written per step (8 MB of int64).
BLOCK_ITEMS = 1 << 20
_COPY_BUFFER = 16 << 20


@dataclass
class MergeResult:
    """What a merge wrote.

    Attributes:
        prefix: The output prefix.
        inputs: The input prefixes, in merge order.
        documents: Documents in the output.
        sequences: Sequences in the output.
        tokens: Tokens in the output.
        bytes: Size of the output ``.bin`` plus ``.idx``.
        seconds: Wall-clock time.
        dtype: The token dtype.
    """

    prefix: str
    inputs: List[str]
    documents: int
    sequences: int
    tokens: int
    bytes: int
    seconds: float
    dtype: str

    def summary(self) -> str:
        """One line: inputs, documents, tokens, MB and MB/s."""
        rate = self.bytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")
        return (f"merged {len(self.inputs)} datasets: {self.documents} documents, {self.tokens} tokens, "
                f"{self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s ({rate:,.0f} MB/s)")


@dataclass
class _Input:
    prefix: str
    dtype: np.dtype
    sequences: int
    documents: int  # entries of the document index, minus the leading 0
    bin_bytes: int


def expand_dataset_inputs(inputs: Sequence[str]) -> List[str]:
    """Prefixes named by ``inputs``: a prefix (``.bin``/``.idx`` suffix tolerated) or a directory.

    A directory stands for every ``.idx`` prefix in it, in sorted order, as Megatron's tool reads it.

    Raises:
        DataError: an input that names no dataset, or a directory without one.
    """
    prefixes: List[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, name[:-4]) for name in os.listdir(item)
                           if name.endswith(".idx") and not name.startswith("."))
            if not found:
                raise DataError(f"--input {item}: directory holds no .idx/.bin dataset")
            prefixes.extend(found)
            continue
        prefix = item[:-4] if item.endswith((".bin", ".idx")) else item
        for path in (index_file_path(prefix), data_file_path(prefix)):
            if not os.path.isfile(path):
                raise DataError(f"--input {item}: {path} not found")
        prefixes.append(prefix)
    if not prefixes:
        raise DataError("--input: no datasets given")
    return prefixes


def _open_input(prefix: str) -> _Input:
    bin_bytes = os.path.getsize(data_file_path(prefix))
    fields = read_index(index_file_path(prefix), bin_bytes)  # validates every field against the .bin
    sequences, doc_length = len(fields["sizes"]), len(fields["document_index"])
    if os.path.getsize(index_file_path(prefix)) != HEADER_SIZE + 12 * sequences + 8 * doc_length:
        raise DataError(f"{index_file_path(prefix)}: carries multimodal sequence modes, which merge-datasets "
                        "does not support")
    return _Input(prefix, fields["dtype"], sequences, doc_length - 1, bin_bytes)


def _check_meta(item: _Input, meta: Optional[DatasetMeta]) -> None:
    if meta is None:
        return
    if (meta.dtype, meta.sequences, meta.documents) != (str(item.dtype), item.sequences, item.documents):
        raise DataError(f"{meta_path(item.prefix)} does not describe {index_file_path(item.prefix)} (it records "
                        f"{meta.documents} documents, {meta.sequences} sequences, {meta.dtype}; the index has "
                        f"{item.documents}, {item.sequences}, {item.dtype}): stale sidecar?")


def _copy_section(handle: BinaryIO, item: _Input, offset: int, count: int, dtype: str, out: BinaryIO,
                  add: int = 0) -> None:
    """Streams ``count`` items of ``dtype`` from byte ``offset`` of an ``.idx``, plus ``add``, to ``out``."""
    handle.seek(offset)
    for first in range(0, count, BLOCK_ITEMS):
        wanted = min(BLOCK_ITEMS, count - first)
        block = np.fromfile(handle, dtype=dtype, count=wanted)
        if len(block) != wanted:  # the file shrank after it was validated
            raise DataError(f"{index_file_path(item.prefix)}: truncated while merging")
        if add:
            block += add
        out.write(block.tobytes())


def merge_datasets(inputs: Sequence[str], output_prefix: str) -> MergeResult:
    """Concatenates the datasets ``inputs`` (prefixes or directories, in order) into ``output_prefix``.

    Raises:
        DataError: before any output is written, for a missing or invalid input, dtypes or tokenizers
            that differ, or an output prefix that is also an input.
    """
    start = time.perf_counter()
    if not output_prefix or output_prefix.endswith(os.sep):
        raise DataError(f"--output-prefix must name a file prefix, got {output_prefix!r}")
    check_output_name(output_prefix)
    prefixes = expand_dataset_inputs(inputs)
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise DataError(f"--output-prefix {output_prefix} is also an input; choose another name")
    items = [_open_input(prefix) for prefix in prefixes]
    for item in items[1:]:
        if item.dtype != items[0].dtype:
            raise DataError(f"{item.prefix} has token dtype {item.dtype} but {items[0].prefix} has "
                            f"{items[0].dtype}; datasets of different dtypes cannot be merged")
    metas = [read_meta(prefix) for prefix in prefixes]
    for item, meta in zip(items, metas):
        _check_meta(item, meta)
    unchecked = check_same_tokenizer(prefixes, metas)
    if unchecked and len(unchecked) < len(prefixes):
        logger.warning("cannot check the tokenizer of %s (no .meta.json sidecar: written by another tool?)",
                       ", ".join(unchecked))
    dtype = items[0].dtype
    sequences = sum(item.sequences for item in items)
    documents = sum(item.documents for item in items)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    sweep_temporaries(temporary_paths(output_prefix) + [meta_path(output_prefix)])  # a killed merge's leftovers; live writers' are kept
    # Owned (record-locked) until renamed: see domino.atomic_files.open_owned_temporary.
    bin_temp, out_bin = open_owned_temporary(data_file_path(output_prefix))
    idx_temp, out_idx = open_owned_temporary(index_file_path(output_prefix))
    try:
        with out_bin, out_idx:
            for item in items:
                with open(data_file_path(item.prefix), "rb") as source:
                    shutil.copyfileobj(source, out_bin, _COPY_BUFFER)
            out_idx.write(index_header(dtype, sequences, documents + 1))
            # The three sections in file order: lengths as they are, pointers shifted by the bytes of the
            # inputs before, document ends shifted by their sequences (Megatron's offset + doc_idx[1:]).
            handles = [open(index_file_path(item.prefix), "rb") for item in items]
            try:
                for handle, item in zip(handles, items):
                    _copy_section(handle, item, HEADER_SIZE, item.sequences, "<i4", out_idx)
                byte_offset = 0
                for handle, item in zip(handles, items):
                    _copy_section(handle, item, HEADER_SIZE + 4 * item.sequences, item.sequences, "<i8", out_idx,
                                  add=byte_offset)
                    byte_offset += item.bin_bytes
                out_idx.write(np.zeros(1, dtype="<i8").tobytes())
                sequence_offset = 0
                for handle, item in zip(handles, items):
                    _copy_section(handle, item, HEADER_SIZE + 12 * item.sequences + 8, item.documents, "<i8",
                                  out_idx, add=sequence_offset)
                    sequence_offset += item.sequences
            finally:
                for handle in handles:
                    handle.close()
            for out in (out_bin, out_idx):
                out.flush()
                os.fsync(out.fileno())
            remove_quietly(meta_path(output_prefix))
            commit_dataset(bin_temp, idx_temp, output_prefix, synced=True)  # renamed while still owned
    except BaseException:
        remove_quietly(bin_temp)
        remove_quietly(idx_temp)
        raise
    tokens = sum(item.bin_bytes for item in items) // dtype.itemsize
    if not unchecked:
        first = metas[0]
        write_meta(output_prefix, DatasetMeta(
            tokenizer=first.tokenizer, tokenizer_sha256=first.tokenizer_sha256, vocab_size=first.vocab_size,
            eod=first.eod, dtype=str(dtype), documents=documents, sequences=sequences, tokens=tokens))
    result = MergeResult(
        prefix=output_prefix, inputs=prefixes, documents=documents, sequences=sequences, tokens=tokens,
        bytes=os.path.getsize(data_file_path(output_prefix)) + os.path.getsize(index_file_path(output_prefix)),
        seconds=time.perf_counter() - start, dtype=str(dtype))
    logger.info("merge-datasets: %s -> %s.bin/.idx", result.summary(), output_prefix)
    return result
