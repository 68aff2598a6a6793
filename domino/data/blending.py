"""Weighted blending of several datasets, with Megatron's blending-index semantics.

Megatron's ``build_blending_indices`` (``helpers.cpp``) assigns sample ``i`` of the blend to the
dataset whose share lags most behind its weight: ``argmax_d(w_d * max(i, 1) - taken_d)``, ties to the
lowest index, and takes that dataset's next sample. :func:`build_blending_indices` reproduces it
exactly (same double-precision arithmetic):

* one dataset: trivially vectorised;
* two datasets (the common case): dataset 0's picks follow a closed form (its ``k``-th pick is at step
  ``ceil(k / w_0)``), computed for all steps at once and then verified against the greedy rule in one
  vectorised pass; a floating-point near-tie the closed form gets wrong is repaired by running the
  greedy loop over a short window from that step, after which the closed form is back in step;
* three or more datasets: the greedy rule has no closed form; it runs as a scalar loop (about 1 µs per
  sample and dataset), which is why the :class:`BlendableDataset` indices are cached like the others.
"""

from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from domino.data import index_cache
from domino.data.errors import DataError

logger = logging.getLogger(__name__)


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """Weights as float64 fractions summing to 1 (Megatron normalises the same way)."""
    array = np.asarray(weights, dtype=np.float64)
    if array.ndim != 1 or len(array) == 0 or (array < 0).any() or not array.sum() > 0:
        raise DataError(f"blend weights must be >= 0 with a positive sum, got {list(weights)}")
    return array / array.sum()


def _greedy(weights: Sequence[float], start: int, stop: int, taken: List[int],
            dataset_index: np.ndarray, sample_index: np.ndarray) -> None:
    """Megatron's loop for steps ``[start, stop)``; ``taken`` holds the per-dataset counts and is updated."""
    weights = [float(w) for w in weights]
    count = len(weights)
    for step in range(start, stop):
        x = max(float(step), 1.0)
        best, best_error = 0, weights[0] * x - taken[0]
        for d in range(1, count):
            error = weights[d] * x - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[step] = best
        sample_index[step] = taken[best]
        taken[best] += 1


def _two_dataset_guess(w0: float, size: int) -> np.ndarray:
    """1 where the closed form says dataset 1 is picked, 0 for dataset 0."""
    choice = np.ones(size, dtype=np.uint8)
    if size == 0:
        return choice
    if w0 >= 1.0 - w0:  # step 0 compares w_d * 1.0 - 0: the larger weight wins, dataset 0 on ties
        choice[0] = 0
    elif size > 1:
        choice[1] = 0
    if w0 > 0:
        k = np.arange(1, int(math.ceil(w0 * size)) + 2, dtype=np.float64)
        steps = np.ceil(k / w0).astype(np.int64)
        choice[steps[steps < size]] = 0
    return choice


#: Steps run by the exact loop after a near-tie before checking that the closed form is back in step.
_REPAIR_WINDOW = 64


def _two_dataset(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    choice = _two_dataset_guess(float(weights[0]), size)
    picked0 = (choice == 0).astype(np.int64)
    taken0 = np.cumsum(picked0) - picked0  # dataset 0 samples taken before each step
    steps = np.arange(size, dtype=np.int64)
    x = np.maximum(steps.astype(np.float64), 1.0)
    error0 = weights[0] * x - taken0.astype(np.float64)
    error1 = weights[1] * x - (steps - taken0).astype(np.float64)
    greedy = (error1 > error0).astype(np.uint8)
    wrong = np.flatnonzero(greedy != choice)
    dataset_index = choice
    sample_index = np.where(choice == 0, taken0, steps - taken0)
    position = 0
    while True:  # repair each floating-point near-tie the closed form got wrong with the exact loop
        later = wrong[wrong >= position]
        if not len(later):
            break
        first = int(later[0])
        stop = min(size, first + _REPAIR_WINDOW)
        taken = [int(taken0[first]), first - int(taken0[first])]
        _greedy(weights, first, stop, taken, dataset_index, sample_index)
        if stop == size:
            break
        if taken[0] != int(taken0[stop]):  # not back in step with the closed form: finish exactly
            _greedy(weights, stop, size, taken, dataset_index, sample_index)
            break
        position = stop  # same counts as the closed form again, so its verification holds from here
    return dataset_index, sample_index.astype(np.int64)


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset of each blend sample as uint8, sample index within that dataset as int64), as Megatron.

    Args:
        weights: one weight per dataset (normalised here), fewer than 255 datasets.
        size: number of blend samples.
    """
    weights = normalize_weights(weights)
    if len(weights) >= 255:
        raise DataError(f"at most 254 datasets can be blended, got {len(weights)}")
    if len(weights) == 1:
        return np.zeros(size, dtype=np.uint8), np.arange(size, dtype=np.int64)
    if len(weights) == 2:
        return _two_dataset(weights, size)
    dataset_index = np.zeros(size, dtype=np.uint8)
    sample_index = np.zeros(size, dtype=np.int64)
    _greedy(weights, 0, size, [0] * len(weights), dataset_index, sample_index)
    return dataset_index, sample_index


class BlendableDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (Megatron's BlendableDataset).

    Item ``i`` is item ``sample_index[i]`` of dataset ``dataset_index[i]``. The indices are cached in
    ``data_cache_path`` when given (keyed by the datasets' descriptions, the weights and the size).
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int,
                 data_cache_path: Optional[str] = None, description: Optional[dict] = None) -> None:
        if len(datasets) != len(weights):
            raise DataError(f"{len(datasets)} datasets but {len(weights)} blend weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        if data_cache_path is not None and description is not None:
            key = {"kind": "BlendableDataset", "weights": self.weights.tolist(), "size": self.size,
                   "arrays": ["dataset_index", "dataset_sample_index"], **description}
            arrays = index_cache.load_or_build(data_cache_path, key, self._build_arrays, self._check_arrays)
            self.dataset_index = arrays["dataset_index"]
            self.dataset_sample_index = arrays["dataset_sample_index"]
        else:
            self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        for d, dataset in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if len(used) and int(used.max()) >= len(dataset):
                raise DataError(f"blend needs {int(used.max()) + 1} samples of dataset {d} but it has {len(dataset)}")

    def _build_arrays(self) -> Dict[str, np.ndarray]:
        dataset_index, sample_index = build_blending_indices(self.weights, self.size)
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def _check_arrays(self, arrays: Dict[str, np.ndarray]) -> None:
        for name, dtype in (("dataset_index", np.uint8), ("dataset_sample_index", np.int64)):
            if arrays[name].shape != (self.size,) or arrays[name].dtype != dtype:
                raise ValueError(f"{name} has shape {arrays[name].shape} and dtype {arrays[name].dtype}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} outside [0, {self.size})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
