"""The index arrays of Megatron's ``GPTDataset``, built exactly as Megatron-LM builds them, in vectorised numpy.

Given the documents of a split (their token counts), a sequence length, a number of samples and a seed:

* :func:`num_epochs`: the fewest passes over the split that yield ``num_samples`` samples;
* :func:`build_document_index`: the split's documents tiled ``epochs`` times and shuffled with
  ``numpy.random.RandomState(seed)``; a short last epoch (under 80 % of an epoch's samples) is shuffled
  on its own so that its documents are not mixed into the earlier epochs;
* :func:`build_sample_index`: ``[S + 1, 2]`` rows of (position in the document index, token offset);
  sample ``i`` is the ``seq_length + 1`` tokens from row ``i`` to row ``i + 1`` inclusive, so
  consecutive samples share one boundary token. Megatron walks the documents in C++
  (``helpers.cpp``); here the same rows come from one ``searchsorted`` over cumulative lengths;
* :func:`build_shuffle_index`: a permutation of the samples (the separated last epoch shuffled apart).

The random draws happen in Megatron's order on one ``RandomState``, so for equal inputs the arrays are
equal to Megatron's. :func:`build_indices` runs the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

from domino.config.data_specs import parse_split
from domino.data.errors import DataError


def split_boundaries(splits_string: str, size: int) -> List[int]:
    """Document boundaries ``[0, a, b, size]`` of train/valid/test (Megatron's get_train_valid_test_split_).

    Each part gets ``round(fraction * size)`` documents, accumulated, and the rounding surplus is taken
    off every boundary after the first (exactly Megatron's arithmetic, Python's ``round`` included).
    """
    boundaries = [0]
    for fraction in parse_split(splits_string):
        boundaries.append(boundaries[-1] + int(round(fraction * float(size))))
    surplus = boundaries[-1] - size
    return [boundaries[0]] + [b - surplus for b in boundaries[1:]]


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """The fewest epochs with ``(epochs * tokens_per_epoch - 1) // seq_length >= num_samples``."""
    if tokens_per_epoch <= 0:
        raise DataError("the split has no tokens; cannot build samples from it")
    # -1: each sample takes seq_length + 1 tokens, but shares its last one with the next sample, so
    # Megatron's loop stops at the first epochs with epochs * tokens_per_epoch >= num_samples * seq_length + 1.
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    return epochs


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int, epochs: int) -> Tuple[bool, int]:
    """Whether the last epoch is shuffled apart, and the samples of all epochs but the last (Megatron's rule)."""
    if epochs == 1:
        return False, 0
    samples_before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    last_epoch_samples = num_samples - samples_before_last
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    if not 0 <= last_epoch_samples <= samples_per_epoch + 1:
        raise AssertionError("last epoch sample count out of range")  # impossible by num_epochs' definition
    return last_epoch_samples < int(0.80 * samples_per_epoch), samples_before_last


def build_document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_last: bool) -> np.ndarray:
    """The documents tiled ``epochs`` times and shuffled (the last epoch apart when ``separate_last``)."""
    documents = np.asarray(documents, dtype=np.int32)
    if not separate_last or epochs == 1:
        index = np.tile(documents, epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, epochs: int,
                       tokens_per_epoch: int) -> np.ndarray:
    """Rows (position in ``document_index``, offset) where each sample starts; shape ``[S + 1, 2]``.

    Sample ``k`` ends (inclusively) at global token ``k * seq_length`` of the documents laid end to end
    in ``document_index`` order; row ``k`` names the document holding that token and its offset in it.
    Row 0 is ``(0, 0)``. Identical to Megatron's ``build_sample_idx`` walk, including empty documents
    (never named except by row 0) and a boundary on a document's last token (offset = its last token).
    """
    count = (epochs * tokens_per_epoch - 1) // seq_length
    lengths = np.asarray(sizes, dtype=np.int64)[np.asarray(document_index)]
    ends = np.cumsum(lengths)  # exclusive end of each document in the global token stream
    positions = np.arange(1, count + 1, dtype=np.int64) * seq_length
    holder = np.searchsorted(ends, positions, side="right")  # first document whose end lies past the token
    dtype = np.int32 if max(len(document_index), int(lengths.max(initial=0))) < np.iinfo(np.int32).max else np.int64
    index = np.zeros((count + 1, 2), dtype=dtype)
    index[1:, 0] = holder
    index[1:, 1] = positions - (ends[holder] - lengths[holder])
    return index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A shuffled ``[0, num_samples)`` followed by a separately shuffled ``[num_samples, total_size)``."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass
class SampleIndices:
    """The three arrays a ``GPTDataset`` reads samples through."""

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray


def build_indices(sizes: np.ndarray, documents: Sequence[int], seq_length: int, num_samples: int,
                  seed: int) -> SampleIndices:
    """Document, sample and shuffle indices for ``documents`` of a dataset with sequence ``sizes``.

    Args:
        sizes: tokens per sequence of the whole indexed dataset.
        documents: the sequence ids of this split (Megatron's ``documents`` array).
        seq_length: tokens per training sample (each sample holds ``seq_length + 1``).
        num_samples: samples needed; at least this many are indexed (whole epochs).
        seed: seed of the ``RandomState`` shared by both shuffles.
    """
    if seq_length < 1:
        raise DataError(f"--seq-length must be >= 1, got {seq_length}")
    documents = np.asarray(documents, dtype=np.int32)
    tokens_per_epoch = int(np.asarray(sizes, dtype=np.int64)[documents].sum())
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate, samples_before_last = separate_last_epoch(tokens_per_epoch, seq_length, num_samples, epochs)
    document_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(sizes, document_index, seq_length, epochs, tokens_per_epoch)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(samples_before_last if separate else total, total, rng)
    return SampleIndices(document_index, sample_index, shuffle_index)
