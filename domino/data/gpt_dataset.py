"""Megatron's ``GPTDataset``: fixed-length training samples cut across the documents of one split.

A sample is ``seq_length + 1`` consecutive tokens of the split's documents laid end to end in the
(shuffled, epoch-tiled) document-index order; samples are visited in shuffle-index order. Items are
``{"text": np.ndarray[int64] of length seq_length + 1}``; ``tokens = text[:-1]``, ``labels = text[1:]``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Dict, Optional

import numpy as np
import torch

from domino.data import index_cache
from domino.data.errors import DataError
from domino.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path
from domino.data.sample_index import build_indices

logger = logging.getLogger(__name__)


#: Cache file name -> SampleIndices field (Megatron's file names).
_CACHE_NAMES = {"doc_idx": "document_index", "sample_idx": "sample_index", "shuffle_idx": "shuffle_index"}


def _check_arrays(arrays: Dict[str, np.ndarray]) -> None:
    """Rejects cached arrays whose shapes do not fit together (ValueError)."""
    sample = arrays["sample_idx"]
    if sample.ndim != 2 or sample.shape[1] != 2 or sample.shape[0] < 1:
        raise ValueError(f"sample index has shape {sample.shape}, expected [samples + 1, 2]")
    if arrays["shuffle_idx"].shape != (sample.shape[0] - 1,):
        raise ValueError("shuffle index length differs from the sample count")
    if arrays["doc_idx"].ndim != 1 or len(arrays["doc_idx"]) == 0:
        raise ValueError("document index is empty")


def dataset_fingerprint(prefix: str) -> Dict:
    """What identifies a dataset's contents cheaply: absolute path, file sizes and ``.idx`` mtime."""
    idx, binary = index_file_path(prefix), data_file_path(prefix)
    stat = os.stat(idx)
    return {"prefix": os.path.abspath(prefix), "idx_bytes": stat.st_size, "idx_mtime_ns": stat.st_mtime_ns,
            "bin_bytes": os.path.getsize(binary)}


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from ``documents`` of an indexed dataset (Megatron semantics).

    Args:
        name: split name (``train``, ``valid``, ``test``), part of the cache key.
        data_prefix: dataset path prefix.
        documents: sequence ids of the split (Megatron calls them documents; one per document here).
        indexed_dataset: the opened ``IndexedDataset`` of ``data_prefix``.
        splits_string: the ``--split`` string (recorded in the cache description).
        num_samples: samples needed; whole epochs are indexed, so ``len(self) >= num_samples``.
        seq_length: tokens per sample input (samples hold one more).
        seed: data-order seed.
        data_cache_path: directory of the index cache (default: ``index-cache/`` beside the data).
    """

    def __init__(self, name: str, data_prefix: str, documents: np.ndarray, indexed_dataset: IndexedDataset,
                 splits_string: str, num_samples: int, seq_length: int, seed: int,
                 data_cache_path: Optional[str] = None) -> None:
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        documents = np.asarray(documents, dtype=np.int32)
        if len(documents) == 0:
            raise DataError(f"{data_prefix}: the {name} split has no documents")
        if documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise DataError(f"{data_prefix}: {name} split names sequences outside [0, {len(indexed_dataset)})")
        sizes = indexed_dataset.sizes
        if int(np.asarray(sizes[documents], dtype=np.int64).sum()) == 0:
            raise DataError(f"{data_prefix}: the {name} split's documents hold no tokens")
        description = {
            "kind": "GPTDataset", "name": name, **dataset_fingerprint(data_prefix), "split": splits_string,
            "documents": [len(documents), hashlib.sha256(documents.tobytes()).hexdigest()],
            "num_samples": int(num_samples), "seq_length": int(seq_length), "seed": int(seed),
        }
        description["arrays"] = list(_CACHE_NAMES)
        cache_dir = data_cache_path or index_cache.default_cache_dir(data_prefix)

        def build() -> Dict[str, np.ndarray]:
            indices = build_indices(sizes, documents, seq_length, num_samples, seed)
            return {name: getattr(indices, field) for name, field in _CACHE_NAMES.items()}

        arrays = index_cache.load_or_build(cache_dir, description, build, _check_arrays)
        self.document_index = arrays["doc_idx"]
        self.sample_index = arrays["sample_idx"]
        self.shuffle_index = arrays["shuffle_idx"]
        logger.info("%s dataset %s: %d documents, %d samples of %d tokens (%d asked)", name, data_prefix,
                    len(documents), len(self), seq_length, num_samples)

    def __len__(self) -> int:
        # -1: sample i spans rows i and i + 1 of the sample index
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} outside [0, {len(self)})")
        idx = int(self.shuffle_index[idx])
        first_doc, first_offset = (int(v) for v in self.sample_index[idx])
        last_doc, last_offset = (int(v) for v in self.sample_index[idx + 1])
        dataset = self.indexed_dataset
        if first_doc == last_doc:
            sample = dataset.get(int(self.document_index[first_doc]), offset=first_offset,
                                 length=last_offset - first_offset + 1)
        else:
            parts = [dataset.get(int(self.document_index[first_doc]), offset=first_offset)]
            parts.extend(dataset.get(int(self.document_index[i])) for i in range(first_doc + 1, last_doc))
            parts.append(dataset.get(int(self.document_index[last_doc]), length=last_offset + 1))
            sample = np.concatenate(parts)
        return {"text": np.asarray(sample, dtype=np.int64)}
