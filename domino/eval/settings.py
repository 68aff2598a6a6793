"""How much an evaluation reads and in what batches: one declaration for ``domino evaluate``,
:func:`domino.eval.evaluate.evaluate_checkpoint` and the pipeline's evaluate step.

The amount is one of three limits: a token budget (the default: a stated, bounded amount, docs/evaluation.md),
a number of micro-batches, or a number of samples. ``domino evaluate`` takes at most one of their flags; a
count of micro-batches or samples replaces the token budget.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Optional

from domino.config import ConfigError
from domino.config.flags import add_dataclass_flags, flag


def _eval_tokens(text: str) -> Optional[int]:
    """``--eval-tokens``: a positive count, or ``all`` (None: no limit)."""
    if text.strip().lower() == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'all', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (or 'all'), got {value}")
    return value


@dataclass
class EvalSettings:
    """The amount of the selected documents an evaluation reads, and its batch size."""

    eval_tokens: Optional[int] = field(default=65536, metadata=flag(
        type=_eval_tokens, metavar="N|all", exclusive="amount"))
    """Evaluate about N tokens (whole micro-batches, rounded up) of one pass over the selection, a budget that
    never repeats documents; all (None): the whole selection (default: 65536, enough for a perplexity good to
    about 1 % on a small model, and seconds of work on a CPU)."""
    eval_iters: Optional[int] = field(default=None, metadata=flag(metavar="N", exclusive="amount"))
    """Evaluate N micro-batches per data-parallel rank instead (more than one pass repeats documents)."""
    max_samples: Optional[int] = field(default=None, metadata=flag(metavar="N", exclusive="amount"))
    """Evaluate about N samples instead (rounded up to whole micro-batches x data-parallel size)."""
    micro_batch_size: int = field(default=16, metadata=flag(metavar="B"))
    """Samples per forward pass (the default, 16, is the fastest on CPU: docs/evaluation.md)."""

    @property
    def token_budget(self) -> Optional[int]:
        """The token budget in force: ``eval_tokens`` unless a count of micro-batches or samples is given."""
        return None if self.eval_iters is not None or self.max_samples is not None else self.eval_tokens

    def check(self) -> None:
        """Raises :class:`~domino.config.ConfigError` naming the flag of a value that cannot work."""
        if self.micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size must be >= 1, got {self.micro_batch_size}")
        for name, value in (("--eval-iters", self.eval_iters), ("--max-samples", self.max_samples),
                            ("--eval-tokens", self.eval_tokens)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.eval_iters is not None and self.max_samples is not None:
            raise ConfigError("--eval-iters and --max-samples: give one amount, not both")


def add_eval_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the flags of :class:`EvalSettings` (``--eval-tokens``, ``--eval-iters``, ``--max-samples``,
    ``--micro-batch-size``) with its defaults."""
    add_dataclass_flags(parser, EvalSettings)


def eval_settings_from_args(args: argparse.Namespace) -> EvalSettings:
    """The :class:`EvalSettings` of flags parsed by a parser :func:`add_eval_flags` made."""
    return EvalSettings(**{f.name: getattr(args, f.name) for f in fields(EvalSettings)})
