"""``build_train_valid_test_datasets``: the train/valid/test ``GPTDataset``s (or blends) of ``--data-path``.

Follows Megatron-LM's ``gpt_dataset.build_train_valid_test_datasets``:

* ``data_prefix = ["corpus"]``: one dataset, its documents split by ``splits_string`` (``949,50,1``);
* ``data_prefix = ["0.3", "a", "0.7", "b"]``: each dataset split the same way, asked for
  ``ceil(n * weight * 1.005)`` samples per split, and blended by weight (:class:`BlendableDataset`);
  a list of prefixes without weights blends them with equal weights;
* ``train_data_prefix`` / ``valid_data_prefix`` / ``test_data_prefix``: whole datasets per split, used
  when ``data_prefix`` is empty (each may again be a weighted list).

A split that gets no documents, or is asked for 0 samples, is ``None``.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from domino.config.data_specs import PrefixSpec, parse_data_prefix
from domino.data.blending import BlendableDataset
from domino.data.errors import DataError
from domino.data.gpt_dataset import GPTDataset, dataset_fingerprint
from domino.data import index_cache
from domino.data.index_cache import default_cache_dir
from domino.data.indexed_dataset import IndexedDataset
from domino.data.limits import TOKEN_CHECK_BLOCK
from domino.data.sample_index import split_boundaries

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def blend_sample_counts(weights: Sequence[float], num_samples: Sequence[int]) -> List[List[int]]:
    """Samples each dataset of a blend is asked for: ``ceil(n * weight * 1.005)`` (Megatron's 0.5 % margin)."""
    total = sum(weights)
    if total <= 0:
        raise DataError(f"blend weights must have a positive sum, got {list(weights)}")
    return [[int(math.ceil(n * (w / total) * 1.005)) for n in num_samples] for w in weights]


def _open(prefix: str, skip_warmup: bool, vocab_size: Optional[int] = None,
          data_cache_path: Optional[str] = None) -> IndexedDataset:
    logger.info("opening indexed dataset %s", prefix)
    dataset = IndexedDataset(prefix, mmap_warmup=not skip_warmup)
    if vocab_size is not None:
        check_token_ids(dataset, vocab_size, data_cache_path or default_cache_dir(prefix))
    return dataset


def check_token_ids(dataset: IndexedDataset, vocab_size: int, cache_dir: str) -> None:
    """Fails when a token id of ``dataset`` lies outside ``[0, vocab_size)`` (it would index past the embedding).

    The scan reads ``.bin`` blockwise (:data:`domino.data.limits.TOKEN_CHECK_BLOCK` tokens at a time); its
    verdict is cached in the index cache under the dataset's fingerprint and the vocabulary size, so each
    dataset is scanned once (by rank 0, in an agreement, when distributed).

    Raises:
        DataError: naming the ``.bin`` file, the first bad token id and its position.
    """
    description = {"kind": "token-check", **dataset_fingerprint(dataset.prefix), "vocab_size": int(vocab_size),
                   "arrays": ["first_outside"]}

    def scan() -> Dict[str, np.ndarray]:
        found = dataset.first_token_outside(vocab_size, TOKEN_CHECK_BLOCK)
        return {"first_outside": np.asarray(found if found is not None else (-1, -1), dtype=np.int64)}

    position, token = (int(v) for v in index_cache.load_or_build(cache_dir, description, scan)["first_outside"])
    if position >= 0:
        raise DataError(f"{dataset.prefix}.bin: token id {token} at position {position} is outside the vocabulary "
                        f"of {vocab_size} tokens (was it preprocessed with another tokenizer?)")


def _split_datasets(prefix: str, splits_string: str, num_samples: Sequence[int], seq_length: int, seed: int,
                    skip_warmup: bool, data_cache_path: Optional[str],
                    vocab_size: Optional[int] = None) -> List[Optional[GPTDataset]]:
    indexed = _open(prefix, skip_warmup, vocab_size, data_cache_path)
    bounds = split_boundaries(splits_string, len(indexed))
    datasets: List[Optional[GPTDataset]] = []
    for index, name in enumerate(SPLIT_NAMES):
        start, stop = bounds[index], bounds[index + 1]
        if stop <= start or num_samples[index] <= 0:
            datasets.append(None)
            continue
        documents = np.arange(start, stop, dtype=np.int32)
        datasets.append(GPTDataset(name, prefix, documents, indexed, splits_string, num_samples[index],
                                   seq_length, seed, data_cache_path))
    return datasets


def _blend(name: str, parts: List[Optional[GPTDataset]], weights: Sequence[float], size: int,
           prefixes: Sequence[str], seed: int, data_cache_path: Optional[str]) -> Optional[BlendableDataset]:
    kept = [(dataset, weight, prefix) for dataset, weight, prefix in zip(parts, weights, prefixes)
            if dataset is not None]
    if not kept or size <= 0:
        return None
    description = {"name": name, "seed": seed, "parts": [
        {**dataset_fingerprint(prefix), "samples": len(dataset), "seq_length": dataset.seq_length}
        for dataset, _, prefix in kept]}
    cache = data_cache_path or default_cache_dir(kept[0][2])
    return BlendableDataset([d for d, _, _ in kept], [w for _, w, _ in kept], size, cache, description)


def _whole_dataset(name: str, spec: PrefixSpec, num_samples: int, seq_length: int, seed: int, skip_warmup: bool,
                   data_cache_path: Optional[str], vocab_size: Optional[int] = None):
    prefixes, weights = parse_data_prefix(spec, f"--{name}-data-path")
    if not prefixes or num_samples <= 0:
        return None
    if len(prefixes) == 1:
        index = SPLIT_NAMES.index(name)
        counts = [0, 0, 0]
        counts[index] = num_samples
        split = ",".join("1" if i == index else "0" for i in range(3))  # every document in this split
        return _split_datasets(prefixes[0], split, counts, seq_length, seed, skip_warmup, data_cache_path,
                               vocab_size)[index]
    weights = weights or [1.0] * len(prefixes)
    counts = blend_sample_counts(weights, [num_samples])
    parts = [_whole_dataset(name, [p], c[0], seq_length, seed, skip_warmup, data_cache_path, vocab_size)
             for p, c in zip(prefixes, counts)]
    return _blend(name, parts, weights, sum(c[0] for c in counts), prefixes, seed, data_cache_path)


def build_train_valid_test_datasets(data_prefix: PrefixSpec, splits_string: str,
                                    train_valid_test_num_samples: Sequence[int], seq_length: int, seed: int,
                                    skip_warmup: bool, train_data_prefix: PrefixSpec = None,
                                    valid_data_prefix: PrefixSpec = None, test_data_prefix: PrefixSpec = None,
                                    data_cache_path: Optional[str] = None, vocab_size: Optional[int] = None):
    """(train, valid, test) datasets; each item is ``{"text": int64 array of seq_length + 1}``; None if empty.

    Args:
        data_prefix: one prefix, or a list (``["0.3", "a", "0.7", "b"]`` for a weighted blend); may be
            None/empty when the per-split prefixes are given.
        splits_string: train/valid/test proportions of the documents, e.g. ``"949,50,1"``.
        train_valid_test_num_samples: samples each split must provide.
        seq_length: tokens per sample input.
        seed: data-order seed.
        skip_warmup: do not pre-read the memory-mapped files.
        train_data_prefix, valid_data_prefix, test_data_prefix: whole datasets per split (instead of
            splitting ``data_prefix``).
        data_cache_path: directory for the cached indices (default: ``index-cache/`` beside each dataset).
        vocab_size: when given, every dataset's token ids are checked to lie below it (see
            :func:`check_token_ids`).

    Raises:
        DataError: for missing or corrupt datasets, malformed prefix lists or bad split strings.
    """
    counts = [int(n) for n in train_valid_test_num_samples]
    if len(counts) != 3 or any(n < 0 for n in counts):
        raise DataError(f"train_valid_test_num_samples must be three counts >= 0, got {list(counts)}")
    prefixes, weights = parse_data_prefix(data_prefix)
    if prefixes:
        if len(prefixes) == 1:
            return tuple(_split_datasets(prefixes[0], splits_string, counts, seq_length, seed, skip_warmup,
                                         data_cache_path, vocab_size))
        weights = weights or [1.0] * len(prefixes)
        per_dataset = blend_sample_counts(weights, counts)
        parts = [_split_datasets(p, splits_string, c, seq_length, seed, skip_warmup, data_cache_path, vocab_size)
                 for p, c in zip(prefixes, per_dataset)]
        return tuple(
            _blend(name, [part[i] for part in parts], weights, sum(c[i] for c in per_dataset), prefixes, seed,
                   data_cache_path)
            for i, name in enumerate(SPLIT_NAMES))
    specs = (train_data_prefix, valid_data_prefix, test_data_prefix)
    if not any(parse_data_prefix(s)[0] for s in specs):
        raise DataError("no data: give --data-path, or --train-data-path/--valid-data-path/--test-data-path")
    return tuple(_whole_dataset(name, spec, n, seq_length, seed, skip_warmup, data_cache_path, vocab_size)
                 for name, spec, n in zip(SPLIT_NAMES, specs, counts))
