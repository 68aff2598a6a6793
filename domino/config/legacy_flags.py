"""Renamed flags of Megatron-LM's 2020-2022 ``megatron/arguments.py``, read with today's meaning.

Older launch scripts still pass them. Each one is translated into the fields of its modern spelling, with one
deprecation note per flag; none is ignored where it changes what is trained. Their meanings, read from
NVIDIA/Megatron-LM:

- ``--checkpoint-activations`` / ``--checkpoint-num-layers N`` (v2.0, commit be473a5b, 2021-01): every chunk of N
  layers (default 1) keeps only its input and is recomputed in backward (``ParallelTransformer._checkpointed_forward``
  in ``megatron/model/transformer.py``), i.e. ``--recompute-granularity full --recompute-method uniform
  --recompute-num-layers N``; Megatron's own deprecation path maps it the same way (commit bbab79f8, 2022-05).
  Without ``--checkpoint-activations``, ``--checkpoint-num-layers`` had no effect.
- ``--activations-checkpoint-method uniform|block`` / ``--activations-checkpoint-num-layers N`` (v2.6, commit
  3860e995, 2021-08): ``--recompute-granularity full --recompute-method uniform|block --recompute-num-layers N``
  (default 1); there ``--checkpoint-activations`` meant ``--activations-checkpoint-method uniform``.
- ``--model-parallel-size``, ``--batch-size``, ``--warmup`` (v1.0, 2020-04): renamed ``--tensor-model-parallel-size``
  (commits 7abd3e90, 52a5f2f2), ``--micro-batch-size`` (9019bbf4) and ``--lr-warmup-fraction`` (22ab91bb, 9321d5c6;
  both a fraction of ``--lr-decay-iters``, else of ``--train-iters``); Megatron v2.0 on stops on them, domino reads
  them as renamed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

from domino.config.validate import ConfigError

_FULL = {"recompute_granularity": "full"}


@dataclass(frozen=True)
class LegacyFlag:
    """One renamed Megatron flag: how it is parsed and which config group its modern spelling lives in."""

    flag: str
    """The old spelling, as scripts pass it."""
    group: str
    """The config group of the fields it sets (the flag exists where that group's flags do)."""
    kind: Any = None
    """The value's type; None for a switch."""
    choices: Optional[Tuple[str, ...]] = None
    """Allowed values, as Megatron's parser had them."""

    @property
    def dest(self) -> str:
        """The namespace attribute, apart from every config field's."""
        return "legacy_" + self.flag[2:].replace("-", "_")


LEGACY_FLAGS: Tuple[LegacyFlag, ...] = (
    LegacyFlag("--checkpoint-activations", "train"),
    LegacyFlag("--checkpoint-num-layers", "train", int),
    LegacyFlag("--activations-checkpoint-method", "train", str, ("uniform", "block")),
    LegacyFlag("--activations-checkpoint-num-layers", "train", int),
    LegacyFlag("--model-parallel-size", "parallel", int),
    LegacyFlag("--batch-size", "train", int),
    LegacyFlag("--warmup", "train", float),
)

#: Plain renames: the old flag's value is the new field's value.
_RENAMED = {"--model-parallel-size": "tensor_model_parallel_size", "--batch-size": "micro_batch_size",
            "--warmup": "lr_warmup_fraction"}


def add_legacy_flags(parser: argparse.ArgumentParser, groups: Iterable[str]) -> None:
    """Adds the old spellings whose modern fields are among ``groups`` (each hidden from ``--help``)."""
    group = parser.add_argument_group("older Megatron-LM spellings (read with today's meaning)")
    for legacy in LEGACY_FLAGS:
        if legacy.group not in groups:
            continue
        if legacy.kind is None:
            group.add_argument(legacy.flag, dest=legacy.dest, action="store_true", default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS)
        else:
            group.add_argument(legacy.flag, dest=legacy.dest, type=legacy.kind, choices=legacy.choices,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _spell(overrides: Dict[str, Any]) -> str:
    return " ".join(f"--{key.replace('_', '-')} {value}" for key, value in overrides.items())


def _meanings(given: Dict[str, Any], explicit: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    """``[(old flag, {field: value})]`` for every old flag given; an empty dict where it has no effect."""
    method = "uniform" if "--checkpoint-activations" in given else given.get("--activations-checkpoint-method")
    full = method is not None or explicit.get("recompute_granularity") == "full"
    layers = given.get("--activations-checkpoint-num-layers", given.get("--checkpoint-num-layers", 1))
    out = []
    for flag, value in given.items():
        if flag == "--checkpoint-activations":
            out.append((flag, {**_FULL, "recompute_method": "uniform", "recompute_num_layers": layers}))
        elif flag == "--activations-checkpoint-method":
            out.append((flag, {**_FULL, "recompute_method": value, "recompute_num_layers": layers}))
        elif flag in ("--checkpoint-num-layers", "--activations-checkpoint-num-layers"):
            out.append((flag, {"recompute_num_layers": value} if full else {}))
        else:
            out.append((flag, {_RENAMED[flag]: value}))
    if "--checkpoint-activations" in given and given.get("--activations-checkpoint-method", "uniform") != "uniform":
        raise ConfigError("--checkpoint-activations means --activations-checkpoint-method uniform; it contradicts "
                          f"--activations-checkpoint-method {given['--activations-checkpoint-method']}")
    return out


def translate(values: Dict[str, Any], explicit: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """The field overrides meant by the old flags in ``values`` (a parsed namespace as a dict), and one
    deprecation note per old flag given.

    Args:
        values: Every parsed value, old spellings under :attr:`LegacyFlag.dest`.
        explicit: The config fields given on the command line with their modern spellings.

    Raises:
        ConfigError: An old flag contradicts the modern spelling given beside it.
    """
    given = {legacy.flag: values[legacy.dest] for legacy in LEGACY_FLAGS if legacy.dest in values}
    overrides: Dict[str, Any] = {}
    notes = []
    for flag, meaning in _meanings(given, explicit):
        for key, value in meaning.items():
            if key in explicit and explicit[key] != value:
                raise ConfigError(f"{flag} means --{key.replace('_', '-')} {value}; it contradicts "
                                  f"--{key.replace('_', '-')} {explicit[key]}")
        overrides.update(meaning)
        what = f"read as {_spell(meaning)}" if meaning else "no effect without a full recompute, as in Megatron"
        notes.append(f"{flag} is an older Megatron-LM spelling: {what}")
    return overrides, notes
