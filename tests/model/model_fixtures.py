"""Tiny GPT configurations, inputs and comparison helpers shared by the model tests."""

from __future__ import annotations

from typing import Dict

import torch

from domino.config import ModelConfig
from domino.model import GPTModel
from domino.overlap.schedule import apply_domino
from domino.overlap.sequence_parallel import apply_sequence_parallel
from domino.runtime import state

VOCAB = 64  # already "padded": divisible by TP 2


def tiny_config(**overrides) -> ModelConfig:
    """Two layers, width 32, 4 heads, no dropout: fast and exact enough for 1e-5 comparisons."""
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, max_position_embeddings=16,
                  hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return ModelConfig(**fields)


def build_model(config: ModelConfig, vocab: int = VOCAB, chunks: int = 1, sequence_parallel: bool = False,
                tp=None, **kwargs) -> GPTModel:
    """A ``GPTModel`` with sequence parallelism and ``chunks`` Domino chunks applied as training applies them,
    split over ``tp`` (default: the TP group of the mesh this test process started, as an entry point passes it)."""
    model = GPTModel(config, vocab, tp=state.current_mesh().tp if tp is None else tp, **kwargs)
    if sequence_parallel:
        apply_sequence_parallel(model)
    return apply_domino(model, chunks)


def random_batch(seed: int, batch: int = 4, seq: int = 8) -> Dict[str, torch.Tensor]:
    """Tokens, labels, per-token loss weights and a reset-attention-mask style mask with position ids."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    weights = torch.rand(batch, seq, generator=g)
    # Documents end at random places; a token attends only to earlier tokens of its own document.
    doc = torch.cumsum((torch.rand(batch, seq, generator=g) < 0.3).long(), dim=1)
    same_doc = doc.unsqueeze(2) == doc.unsqueeze(1)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = ~(same_doc & causal).unsqueeze(1)  # True = masked
    starts = torch.zeros_like(doc)
    for b in range(batch):
        for s in range(seq):
            starts[b, s] = s if s == 0 or doc[b, s] != doc[b, s - 1] else starts[b, s - 1]
    positions = torch.arange(seq).unsqueeze(0) - starts
    return dict(tokens=tokens, labels=labels, weights=weights, attention_mask=mask, position_ids=positions)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    """max |a - e| <= rel * max |e| (a relative tolerance robust to near-zero entries)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max()
    assert err <= rel * scale, f"{what}: max error {err:.3e} exceeds {rel:g} x {scale:.3e}"


def logits_losses_grads(model, batch: Dict[str, torch.Tensor], masked: bool):
    """Logits (no grad), then per-token losses with labels and the gradients of their weighted sum."""
    extra = dict(attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]) if masked else {}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(batch["tokens"], **extra)
    losses = model(batch["tokens"], labels=batch["labels"], **extra)
    (losses * batch["weights"]).sum().backward()
    return logits, losses.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def train_and_measure(model, vocab: int, steps: int = 3, lr: float = 0.5):
    """``steps`` SGD steps on seeded random batches of 4 x ``model.config.seq_length`` tokens.

    Returns the losses, the last step's gradients, and the tensor bytes the first forward kept (activations).
    """
    from domino.train.memory_probe import LiveTensorBytes

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(5)
    losses, kept, grads = [], None, {}
    for _ in range(steps):
        tokens, labels = (torch.randint(0, vocab, (4, model.config.seq_length), generator=g) for _ in range(2))
        with LiveTensorBytes() as mode:
            loss = model(tokens, labels=labels).mean()
        kept = kept if kept is not None else mode.live
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return losses, grads, kept
