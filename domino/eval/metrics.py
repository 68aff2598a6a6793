"""Language-model metrics over batches: masked loss, perplexity and next-token accuracy, TP-aware.

Logits stay split along the vocabulary on tensor-parallel ranks: the loss comes from
:func:`domino.parallel.cross_entropy.vocab_parallel_cross_entropy` and the prediction from
:func:`vocab_parallel_argmax` (two small all-reduces), so no rank ever holds ``[b, s, V]``. Sums are
kept in float64 so that the result does not depend on how samples are grouped into batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from domino.runtime.mesh import collective_device
from domino.parallel.collectives import SINGLE, MeshGroup, all_reduce_max_
from domino.parallel.cross_entropy import vocab_parallel_cross_entropy

#: ``(tokens, labels, loss_mask, attention_mask, position_ids)`` as produced by ``domino.data.batch.get_batch``.
Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


def vocab_parallel_argmax(logits: torch.Tensor, tp: MeshGroup = SINGLE) -> torch.Tensor:
    """The argmax over the full vocabulary of logits ``[..., V/tp]`` split over ``tp``; ties go to the lowest id.

    Equal to ``torch.argmax(full_logits, -1)`` on every TP rank.
    """
    rank, world = tp.rank, tp.size
    local_max, local_index = logits.float().max(dim=-1)
    if world == 1:
        return local_index
    global_max = all_reduce_max_(local_max.clone(), tp)
    vocab = logits.shape[-1] * world
    # Ranks not holding the maximum propose an id past the vocabulary; the smallest proposal wins
    # (computed as a max of negated ids, since only max and sum reductions are needed elsewhere).
    candidate = torch.where(local_max == global_max, local_index + rank * logits.shape[-1],
                            torch.full_like(local_index, vocab))
    return -all_reduce_max_(-candidate, tp)


@dataclass
class MetricTotals:
    """Running sums of one evaluation."""

    loss_sum: float = 0.0
    correct: int = 0
    tokens: int = 0

    def add(self, losses: torch.Tensor, predictions: torch.Tensor, labels: torch.Tensor,
            loss_mask: torch.Tensor) -> None:
        """Adds per-token ``losses`` and ``predictions`` where ``loss_mask`` is 1."""
        mask = loss_mask.to(torch.float64)
        self.loss_sum += float((losses.to(torch.float64) * mask).sum())
        self.correct += int(((predictions == labels).to(torch.float64) * mask).sum())
        self.tokens += int(mask.sum())

    def all_reduce_data_parallel(self, dp: MeshGroup) -> None:
        """Sums the totals over the data-parallel replicas of ``dp`` (each evaluated different samples)."""
        if dp.size == 1:
            return
        group = dp.process_group
        packed = torch.tensor([self.loss_sum, self.correct, self.tokens], dtype=torch.float64,
                              device=collective_device(group))  # NCCL reduces CUDA tensors only
        dist.all_reduce(packed, group=group)
        self.loss_sum, self.correct, self.tokens = float(packed[0]), int(packed[1]), int(packed[2])

    def result(self) -> Dict[str, float]:
        """``{"loss", "ppl", "accuracy", "tokens"}``; NaN loss when no token was evaluated."""
        if self.tokens == 0:
            return {"loss": math.nan, "ppl": math.nan, "accuracy": math.nan, "tokens": 0}
        loss = self.loss_sum / self.tokens
        return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "accuracy": self.correct / self.tokens,
                "tokens": self.tokens}


@torch.no_grad()
def batch_metrics(model: torch.nn.Module, batch: Batch, totals: MetricTotals) -> None:
    """Runs ``model`` on one batch and adds its masked loss and accuracy to ``totals``."""
    tokens, labels, loss_mask, attention_mask, position_ids = batch
    logits = model(tokens, position_ids=position_ids, attention_mask=attention_mask)
    if getattr(model, "parallel_output", True):
        losses = vocab_parallel_cross_entropy(logits, labels, model.tp)
        predictions = vocab_parallel_argmax(logits, model.tp)
    else:  # full logits on every rank
        losses = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")
        predictions = logits.argmax(dim=-1)
    totals.add(losses, predictions, labels, loss_mask)


@torch.no_grad()
def evaluate_batches(model: torch.nn.Module, batches: Iterable[Batch], total: Optional[int] = None,
                     progress: bool = False, dp: MeshGroup = SINGLE) -> Dict[str, float]:
    """Loss, perplexity, accuracy and token count of ``model`` over ``batches`` (reduced over ``dp``).

    Args:
        model: a ``GPTModel``; it is put in eval mode for the duration.
        batches: ``(tokens, labels, loss_mask, attention_mask, position_ids)`` tuples.
        total: the number of batches, for the progress bar.
        progress: show a progress bar (on global rank 0 only).
        dp: the data-parallel group whose replicas evaluated other batches (one process by default).
    """
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    was_training = model.training
    model.eval()
    totals = MetricTotals()
    try:
        for batch in tqdm(batches, total=total, disable=not show, desc="evaluate", unit="batch"):
            batch_metrics(model, batch, totals)
    finally:
        model.train(was_training)
    totals.all_reduce_data_parallel(dp)
    return totals.result()
