"""The fields of an untrusted Hugging Face ``config.json``, read with their type and bounds checked.

``int()`` and ``float()`` are no check: ``int(2.5)`` truncates a depth silently, ``int(True)`` is 1, a dict or
``null`` raises a bare TypeError, and an unchecked size reaches a division (``n_head = 0``) or a tensor of
negative or overflowing size. Each reader names the file and the field in one line; the bounds are the ones
every config keeps (:mod:`domino.config.bounds`), looked up by the field of :class:`ModelConfig` the value sets.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from domino.config import ConfigError
from domino.config.bounds import bound

_REQUIRED = object()


def _value(hf_config: Dict[str, Any], key: str, source: str, default: Any) -> Any:
    if key in hf_config and hf_config[key] is not None:
        return hf_config[key]
    if default is _REQUIRED:
        raise ConfigError(f"{source}: missing field {key}")
    return default


def integer(hf_config: Dict[str, Any], key: str, source: str, field: str, default: Any = _REQUIRED) -> Optional[int]:
    """``hf_config[key]`` as the size ``field`` of :class:`ModelConfig`: an integer (``2.0`` is 2, ``2.5`` and
    ``true`` are refused) within that field's bounds; ``default`` when absent or null (required without one)."""
    value = _value(hf_config, key, source, default)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    low, high = bound("model", field)
    if isinstance(value, bool) or not isinstance(value, int) or value < (low or 0) or (high and value > high):
        raise ConfigError(f"{source}: {key} must be an integer from {low or 0} to {high or 'any size'}, "
                          f"got {value!r:.80}")
    return value


def number(hf_config: Dict[str, Any], key: str, source: str, default: Any = _REQUIRED, *,
           minimum: float = 0.0, below: Optional[float] = None, positive: bool = False) -> float:
    """``hf_config[key]`` as a finite number >= ``minimum`` (> 0 when ``positive``, < ``below`` when given)."""
    value = _value(hf_config, key, source, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (positive and value <= 0) or (below is not None and value >= below):
        wanted = f"> {minimum}" if positive else f">= {minimum}"
        raise ConfigError(f"{source}: {key} must be a finite number {wanted}"
                          f"{f' and < {below}' if below is not None else ''}, got {value!r:.80}")
    return float(value)
