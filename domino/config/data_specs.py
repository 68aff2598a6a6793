"""The two data flags with a syntax of their own, read in one place: ``--data-path`` (``[WEIGHT] PREFIX ...``, as
the per-split ``--*-data-path``) and ``--split`` (``949,50,1``). :func:`domino.config.validate.validate` checks them
before a run starts; the dataset builder reads them with the same functions.

Numbers are checked before anything else looks at them: a weight or a split part that is negative, ``nan`` or
``inf`` would otherwise pass ``sum > 0`` (a ``-1`` beside a ``2``) or reach ``int()`` as ``nan``. A dataset of
weight 0 is left out, as a blend would never draw from it (:func:`zero_weight_notes` names them for the log).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

from domino.config.errors import ConfigError
from domino.config.schema import DataConfig

PrefixSpec = Union[None, str, Sequence[str]]


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _weighted_pairs(data_prefix: PrefixSpec, flag: str) -> Tuple[List[str], Optional[List[float]]]:
    """All prefixes with their weights (None for an unweighted list), zero weights included."""
    if data_prefix is None:
        return [], None
    items = [data_prefix] if isinstance(data_prefix, str) else [str(p).strip() for p in data_prefix]
    if not items:
        return [], None
    if len(items) % 2 == 0 and all(_number(items[i]) is not None for i in range(0, len(items), 2)):
        prefixes, weights = items[1::2], [float(items[i]) for i in range(0, len(items), 2)]
        if any(_number(p) is not None for p in prefixes):
            raise ConfigError(f"{flag} {' '.join(items)}: expected 'WEIGHT PREFIX' pairs")
        for weight, prefix in zip(weights, prefixes):
            if not (math.isfinite(weight) and weight >= 0):
                raise ConfigError(f"{flag}: weight {weight:g} of {prefix} must be a finite number >= 0")
        if sum(weights) <= 0:
            raise ConfigError(f"{flag} {' '.join(items)}: the weights must have a positive sum")
        return prefixes, weights
    if any(_number(p) is not None for p in items):
        raise ConfigError(f"{flag} {' '.join(items)}: give a weight before every prefix or before none")
    return items, None


def parse_data_prefix(data_prefix: PrefixSpec, flag: str = "--data-path") -> Tuple[List[str], Optional[List[float]]]:
    """``["0.3", "a", "0.7", "b"]`` -> (``["a", "b"]``, ``[0.3, 0.7]``); unweighted lists give weights None.
    Datasets of weight 0 are left out.

    Raises:
        ConfigError: naming ``flag``, for a list that mixes weighted and unweighted entries, a weight that is
            negative or not finite, or weights that sum to 0.
    """
    prefixes, weights = _weighted_pairs(data_prefix, flag)
    if weights is None:
        return prefixes, None
    kept = [(p, w) for p, w in zip(prefixes, weights) if w > 0]
    return [p for p, _ in kept], [w for _, w in kept]


def parse_split(splits_string: str) -> List[float]:
    """``"949,50,1"`` (or ``"949/50/1"``, or ``"1"``) -> three fractions summing to 1, as Megatron.

    Raises:
        ConfigError: naming ``--split``, for parts that are not numbers, negative or not finite, or sum to 0.
    """
    separator = "," if "," in splits_string else "/"
    try:
        splits = [float(s) for s in splits_string.split(separator)]
    except ValueError:
        raise ConfigError(f"--split {splits_string!r}: expected numbers separated by ',' like 949,50,1") from None
    splits = (splits + [0.0, 0.0])[:3]
    if not all(math.isfinite(s) and s >= 0 for s in splits) or sum(splits) <= 0:
        raise ConfigError(f"--split {splits_string!r}: the parts must be finite numbers >= 0 with a positive sum")
    total = sum(splits)
    return [s / total for s in splits]


def _data_path_flags(data: DataConfig):
    return (("--data-path", data.data_path), ("--train-data-path", data.train_data_path),
            ("--valid-data-path", data.valid_data_path), ("--test-data-path", data.test_data_path))


def data_spec_problems(data: DataConfig) -> List[str]:
    """What is wrong with the ``--*data-path`` weights and the ``--split`` parts, one message each."""
    problems = []
    for flag, values in _data_path_flags(data):
        try:
            parse_data_prefix(values, flag)
        except ConfigError as error:
            problems.append(str(error))
    try:
        parse_split(data.split)
    except ConfigError as error:
        problems.append(str(error))
    return problems


def zero_weight_notes(data: DataConfig) -> List[str]:
    """One line for each dataset that :func:`parse_data_prefix` leaves out for its weight 0 (valid flags only)."""
    notes = []
    for flag, values in _data_path_flags(data):
        prefixes, weights = _weighted_pairs(values, flag)
        notes.extend(f"{flag}: {p} has weight 0 and is left out" for p, w in zip(prefixes, weights or []) if w == 0)
    return notes
