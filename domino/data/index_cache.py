"""On-disk cache of sample indices, keyed by a hash of everything that determines them.

A cache entry is ``{key}_doc_idx.npy``, ``{key}_sample_idx.npy``, ``{key}_shuffle_idx.npy`` and
``{key}_desc.json``; ``key`` is the SHA-256 (first 32 hex digits) of the JSON description (dataset path,
``.idx`` size and modification time, split, document range, sample count, sequence length, seed, format
version). Every file is written atomically and the description, written last, records the SHA-256 of
each array file: an entry whose description is missing, different, or whose arrays do not hash to the
recorded digests is stale or corrupt, and is rebuilt.

With ``torch.distributed`` initialised, global rank 0 builds a missing entry while the other ranks wait
at a barrier, then every rank loads it (a rank that still cannot load it, e.g. on a node that does not
share the cache directory, builds its own copy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Callable, Dict, Optional

import numpy as np

from domino.data.atomic import atomic_write
from domino.data.sample_index import SampleIndices

logger = logging.getLogger(__name__)

#: Bumped whenever the meaning of the cached arrays changes, so old entries are never reused.
CACHE_FORMAT = "domino-gpt-indices-1"

_ARRAYS = {"document_index": "doc_idx", "sample_index": "sample_idx", "shuffle_index": "shuffle_idx"}


def description_key(description: Dict) -> str:
    """The cache key of ``description`` (stable across processes and runs)."""
    text = json.dumps({"format": CACHE_FORMAT, **description}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def default_cache_dir(data_prefix: str) -> str:
    """``index-cache/`` beside the dataset, or a per-user cache when that directory is not writable."""
    beside = os.path.join(os.path.dirname(os.path.abspath(data_prefix)), "index-cache")
    try:
        os.makedirs(beside, exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    fallback = os.path.join(os.path.expanduser("~"), ".cache", "domino", "index-cache")
    logger.warning("%s is not writable; caching sample indices in %s (set --data-cache-path to choose)",
                   beside, fallback)
    return fallback


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _paths(cache_dir: str, key: str) -> Dict[str, str]:
    paths = {field: os.path.join(cache_dir, f"{key}_{suffix}.npy") for field, suffix in _ARRAYS.items()}
    paths["desc"] = os.path.join(cache_dir, f"{key}_desc.json")
    return paths


def try_load(cache_dir: str, description: Dict) -> Optional[SampleIndices]:
    """The cached indices for ``description``, or None when absent, stale or corrupt (the reason is logged)."""
    key = description_key(description)
    paths = _paths(cache_dir, key)
    if not os.path.isfile(paths["desc"]):
        return None
    try:
        with open(paths["desc"]) as handle:
            recorded = json.load(handle)
        if recorded.get("description") != json.loads(json.dumps(description)):
            raise ValueError("its description differs from this dataset's")
        arrays = {}
        for field in _ARRAYS:
            if _file_sha256(paths[field]) != recorded["sha256"][field]:
                raise ValueError(f"{os.path.basename(paths[field])} does not match its recorded SHA-256")
            arrays[field] = np.load(paths[field], mmap_mode="r", allow_pickle=False)
        indices = SampleIndices(**arrays)
        _check_shapes(indices)
        return indices
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("sample-index cache %s in %s is stale or corrupt (%s); rebuilding", key, cache_dir, error)
        return None


def _check_shapes(indices: SampleIndices) -> None:
    sample = indices.sample_index
    if sample.ndim != 2 or sample.shape[1] != 2 or sample.shape[0] < 1:
        raise ValueError(f"sample index has shape {sample.shape}, expected [samples + 1, 2]")
    if indices.shuffle_index.shape != (sample.shape[0] - 1,):
        raise ValueError("shuffle index length differs from the sample count")
    if indices.document_index.ndim != 1 or len(indices.document_index) == 0:
        raise ValueError("document index is empty")


def save(cache_dir: str, description: Dict, indices: SampleIndices) -> None:
    """Writes a cache entry atomically (arrays first, the description with their digests last)."""
    os.makedirs(cache_dir, exist_ok=True)
    paths = _paths(cache_dir, description_key(description))
    digests = {}
    for field in _ARRAYS:
        with atomic_write(paths[field]) as handle:
            np.save(handle, np.ascontiguousarray(getattr(indices, field)), allow_pickle=False)
        digests[field] = _file_sha256(paths[field])
    with atomic_write(paths["desc"], "w") as handle:
        json.dump({"format": CACHE_FORMAT, "description": description, "sha256": digests,
                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, handle, indent=2)


def _distributed() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return dist.is_available() and dist.is_initialized()


def load_or_build(cache_dir: str, description: Dict, build: Callable[[], SampleIndices]) -> SampleIndices:
    """Cached indices for ``description``; rank 0 builds and saves them when missing, the others wait.

    Args:
        cache_dir: the cache directory (created when missing).
        description: JSON-serialisable dict of everything the indices depend on.
        build: computes the indices (called on rank 0, or on a rank that cannot load rank 0's entry).
    """
    distributed = _distributed()
    if distributed:
        import torch.distributed as dist

        indices = _load_or_build_here(cache_dir, description, build) if dist.get_rank() == 0 else None
        dist.barrier()
        if indices is not None:
            return indices
    return _load_or_build_here(cache_dir, description, build)


def _load_or_build_here(cache_dir: str, description: Dict, build: Callable[[], SampleIndices]) -> SampleIndices:
    indices = try_load(cache_dir, description)
    if indices is not None:
        return indices
    start = time.perf_counter()
    indices = build()
    seconds = time.perf_counter() - start
    try:
        save(cache_dir, description, indices)
    except OSError as error:  # training can go on with the indices in memory
        logger.warning("cannot write the sample-index cache in %s (%s); using the indices without caching them",
                       cache_dir, error)
        return indices
    logger.info("built sample indices (%d samples) in %.2f s, cached as %s in %s", len(indices.shuffle_index),
                seconds, description_key(description), cache_dir)
    return try_load(cache_dir, description) or indices
