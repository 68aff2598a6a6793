"""On-disk cache of sample and blending indices, keyed by a hash of everything that determines them.

A cache entry is one ``{key}_{name}.npy`` per array (a ``GPTDataset``: ``doc_idx``, ``sample_idx``,
``shuffle_idx``; a blend: ``dataset_index``, ``dataset_sample_index``) plus ``{key}_desc.json``; ``key``
is the SHA-256 (first 32 hex digits) of the JSON description (for a ``GPTDataset``: dataset path,
``.idx``/``.bin`` sizes and ``.idx`` modification time, split, the split's documents, sample count,
sequence length, seed; always the array names and a format version). Every file is written atomically and the description, written last, records the SHA-256 of
each array file: an entry whose description is missing, different, or whose arrays do not hash to the
recorded digests is stale or corrupt, and is rebuilt.

With ``torch.distributed`` initialised, global rank 0 builds a missing entry while the other ranks wait
in an agreement (``domino.runtime.agreement``: a failure on rank 0 stops every rank), then every rank loads it (a rank that still cannot load it, e.g. on a node that does not
share the cache directory, builds its own copy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from domino.atomic_files import atomic_write
from domino.data.provenance import file_sha256
from domino.runtime.agreement import agree

logger = logging.getLogger(__name__)

#: Bumped whenever the meaning of the cached arrays changes, so old entries are never reused.
CACHE_FORMAT = "domino-indices-2"

Arrays = Dict[str, np.ndarray]
Validator = Callable[[Arrays], None]


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


def _array_path(cache_dir: str, key: str, name: str) -> str:
    return os.path.join(cache_dir, f"{key}_{name}.npy")


def _desc_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"{key}_desc.json")


def try_load(cache_dir: str, description: Dict, names: Sequence[str],
             validate: Optional[Validator] = None) -> Optional[Arrays]:
    """The cached arrays ``names`` for ``description`` (memory-mapped), or None when absent, stale or corrupt.

    ``validate`` may raise ``ValueError`` for arrays that are intact but unusable. The reason an entry is
    rejected is logged.
    """
    key = description_key(description)
    if not os.path.isfile(_desc_path(cache_dir, key)):
        return None
    try:
        with open(_desc_path(cache_dir, key)) as handle:
            recorded = json.load(handle)
        if recorded.get("description") != json.loads(json.dumps(description)):
            raise ValueError("its description differs from this dataset's")
        arrays = {}
        for name in names:
            path = _array_path(cache_dir, key, name)
            if file_sha256(path) != recorded["sha256"][name]:
                raise ValueError(f"{os.path.basename(path)} does not match its recorded SHA-256")
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        if validate is not None:
            validate(arrays)
        return arrays
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("index cache %s in %s is stale or corrupt (%s); rebuilding", key, cache_dir, error)
        return None


def save(cache_dir: str, description: Dict, arrays: Arrays) -> None:
    """Writes a cache entry atomically (arrays first, the description with their digests last)."""
    os.makedirs(cache_dir, exist_ok=True)
    key = description_key(description)
    digests = {}
    for name, array in arrays.items():
        path = _array_path(cache_dir, key, name)
        with atomic_write(path) as handle:
            np.save(handle, np.ascontiguousarray(array), allow_pickle=False)
        digests[name] = file_sha256(path)
    with atomic_write(_desc_path(cache_dir, key), "w") as handle:
        json.dump({"format": CACHE_FORMAT, "description": description, "sha256": digests,
                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, handle, indent=2)


def _distributed() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return dist.is_available() and dist.is_initialized()


def load_or_build(cache_dir: str, description: Dict, build: Callable[[], Arrays],
                  validate: Optional[Validator] = None) -> Arrays:
    """Cached arrays for ``description``; rank 0 builds and saves them when missing, the others wait.

    Args:
        cache_dir: the cache directory (created when missing).
        description: JSON-serialisable dict of everything the arrays depend on.
        build: computes the arrays as ``{name: array}`` (on rank 0, or on a rank that cannot load rank 0's
            entry); the names become file names, ``{key}_{name}.npy``.
        validate: optional check of loaded arrays (raises ``ValueError`` to reject an entry).
    """
    if _distributed():
        import torch.distributed as dist

        # An agreement, not a barrier: when rank 0 cannot build, every rank stops with rank 0's reason.
        arrays = agree(f"building the index cache in {cache_dir}", lambda: _load_or_build_here(
            cache_dir, description, build, validate) if dist.get_rank() == 0 else None)
        if arrays is not None:
            return arrays
    return _load_or_build_here(cache_dir, description, build, validate)


def _load_or_build_here(cache_dir: str, description: Dict, build: Callable[[], Arrays],
                        validate: Optional[Validator]) -> Arrays:
    names = description["arrays"]
    arrays = try_load(cache_dir, description, names, validate)
    if arrays is not None:
        return arrays
    start = time.perf_counter()
    arrays = build()
    seconds = time.perf_counter() - start
    try:
        save(cache_dir, description, arrays)
    except OSError as error:  # training can go on with the arrays in memory
        logger.warning("cannot write the index cache in %s (%s); using the indices without caching them",
                       cache_dir, error)
        return arrays
    logger.info("built %s in %.2f s, cached as %s in %s", ", ".join(names), seconds, description_key(description),
                cache_dir)
    return try_load(cache_dir, description, names, validate) or arrays
