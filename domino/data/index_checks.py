"""The consistency checks of an untrusted ``.idx`` file's arrays, made before anything reads tokens through them.

Run in blocks of :data:`VALIDATION_BLOCK` entries, so that opening a huge index needs little memory.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from domino.data.errors import DataError

#: Entries checked per step when opening an index.
VALIDATION_BLOCK = 1 << 22


def validate_index_arrays(path: str, dtype: np.dtype, sizes: np.ndarray, pointers: np.ndarray,
                          document_index: np.ndarray, bin_size: Optional[int]) -> None:
    """Checks an ``.idx`` file's arrays against each other and the ``.bin`` size (``bin_size``, when given): the
    sizes non-negative, each pointer where the sequences before it end, the document index from 0 to the sequence
    count and non-decreasing.

    Raises:
        DataError: naming ``path``, the field and the first wrong entry.
    """
    count = len(sizes)
    start_byte = 0  # checked in blocks so that opening a huge index needs little memory
    for first in range(0, count, VALIDATION_BLOCK):
        block = np.asarray(sizes[first:first + VALIDATION_BLOCK], dtype=np.int64)
        if int(block.min()) < 0:
            raise DataError(f"{path}: field sizes holds a negative sequence length at sequence "
                            f"{first + int(np.argmin(block))}")
        expected = np.empty(len(block), dtype=np.int64)
        expected[0] = start_byte
        np.cumsum(block[:-1] * dtype.itemsize, out=expected[1:])
        expected[1:] += start_byte
        wrong = np.flatnonzero(pointers[first:first + len(block)] != expected)
        if len(wrong):
            i = first + int(wrong[0])
            raise DataError(f"{path}: field pointers[{i}] = {int(pointers[i])} but the sequences before it end at "
                            f"byte {int(expected[wrong[0]])}")
        start_byte = int(expected[-1]) + int(block[-1]) * dtype.itemsize
    total = (int(pointers[-1]) + int(sizes[-1]) * dtype.itemsize) if count else 0
    if bin_size is not None and bin_size != total:
        raise DataError(f"{path}: the pointers and sizes describe {total} bytes of tokens, but the .bin file has "
                        f"{bin_size} bytes")
    if int(document_index[0]) != 0:
        raise DataError(f"{path}: field document_index starts at {int(document_index[0])}, expected 0")
    if int(document_index[-1]) != count:
        raise DataError(f"{path}: field document_index ends at {int(document_index[-1])}, expected the sequence "
                        f"count {count}")
    for first in range(0, len(document_index) - 1, VALIDATION_BLOCK):
        block = document_index[first:first + VALIDATION_BLOCK + 1]
        # The range first: a difference of int64 values far apart wraps around and could pass as non-negative.
        outside = np.flatnonzero((block < 0) | (block > count))
        if len(outside):
            i = first + int(outside[0])
            raise DataError(f"{path}: field document_index[{i}] = {int(document_index[i])} is outside [0, {count}] "
                            f"(the sequence count)")
        if bool((np.diff(block) < 0).any()):
            raise DataError(f"{path}: field document_index is not non-decreasing")
