"""Validation and test passes during pretraining: masked LM loss and perplexity."""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch


def perplexity(loss: float) -> float:
    """``exp(loss)``, capped so a diverged run reports a large finite number instead of overflowing."""
    return math.exp(min(loss, 50.0))


@torch.no_grad()
def evaluate(forward_step: Callable, make_iterator: Callable[[], Optional[Iterable]], model, eval_iters: int) -> float:
    """Mean of the data-parallel-averaged ``lm loss`` over ``eval_iters`` fresh batches.

    Args:
        forward_step: ``forward_step(data_iterator, model) -> (output, loss_fn)``.
        make_iterator: returns a new iterator over the split (``None`` on ranks that receive broadcasts).
        model: the model to run in eval mode.
        eval_iters: batches to average.
    """
    was_training = model.training
    model.eval()
    iterator = make_iterator()
    total = None
    for _ in range(eval_iters):
        output, loss_fn = forward_step(iterator, model)
        _, stats = loss_fn(output)
        loss = stats["lm loss"].detach().double()
        total = loss if total is None else total + loss  # summed on the device: one host read at the end
    if was_training:
        model.train()
    return float(total) / eval_iters if total is not None else 0.0
