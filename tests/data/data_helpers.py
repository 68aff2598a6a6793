"""Small builders shared by the data tests."""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from domino.data.indexed_dataset import IndexedDatasetWriter


def write_dataset(prefix: str, documents: Sequence[Sequence[int]], dtype=np.uint16) -> str:
    """Writes ``documents`` (one sequence each) with the library writer; returns ``prefix``."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for document in documents:
            writer.add_document(np.asarray(document, dtype=np.int64))
    return prefix


def spec_index_bytes(code: int, sizes: Sequence[int], pointers: Sequence[int], document_index: Sequence[int],
                     modes: bytes = b"") -> bytes:
    """An .idx file built by hand from the format table (independent of the library writer)."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(document_index))
    out += b"".join(struct.pack("<i", s) for s in sizes)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in document_index)
    return out + modes
