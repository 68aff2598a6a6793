"""Choosing the next token from logits: greedy, temperature, top-k and nucleus (top-p) sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from domino.config import ConfigError


@dataclass
class SamplingConfig:
    """How :func:`sample_next_token` picks a token.

    Attributes:
        greedy: always take the most likely token (the other fields are ignored).
        temperature: divide logits by this before sampling (> 0; lower is more conservative).
        top_k: sample only among the ``top_k`` most likely tokens (0 disables).
        top_p: sample only among the smallest set of tokens whose probability reaches ``top_p``
            (1.0 disables).
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> None:
        """Raises :class:`ConfigError` naming the flag when a value is out of range."""
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sets the logits outside the top-k / top-p set to ``-inf`` (last dimension is the vocabulary).

    The most likely token always survives, so the result can always be sampled from.
    """
    logits = logits.clone()
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def sample_next_token(
    logits: torch.Tensor, sampling: SamplingConfig, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Picks one token id per row of ``logits`` ``[batch, vocab]``; returns int64 ``[batch]``.

    Sampling draws from ``generator`` (on the logits' device), so a seeded generator gives the same
    tokens on every run and on every tensor-parallel rank.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.argmax(logits, dim=-1)
    filtered = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = torch.softmax(filtered, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
