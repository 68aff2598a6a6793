"""How close ``domino estimate`` is to measured tensor memory, on small GPT configs on CPU (fp32, TP=1).

For each config, a fresh ``GPTModel`` trains two steps with AdamW under
:class:`~domino.train.memory_probe.LiveTensorBytes` (a dispatch mode counting live tensor storages). Two numbers
are compared with :func:`domino.config.estimate.estimate_layout` (``device="cpu"``):

* **forward**: bytes the first forward adds (activations + logits + the QKV weight copies) vs the estimate's
  ``activations + logits + buffers``;
* **peak**: the most bytes alive over the two steps (weights, AdamW state, activations, gradients) vs ``total``.

Memory is deterministic, so one run suffices. Usage::

    python benchmarks/estimate_check.py [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from domino.config import DominoConfig, ModelConfig
from domino.config.estimate import Layout, estimate_layout
from domino.train.memory_probe import measure_training_memory

CONFIGS = [
    # (layers, hidden, heads, seq, micro-batch, vocab, hidden dropout, attention dropout)
    (2, 128, 4, 256, 4, 1024, 0.1, 0.1),
    (2, 128, 4, 256, 4, 1024, 0.0, 0.0),
    (2, 128, 4, 256, 4, 1024, 0.1, 0.0),
    (4, 256, 8, 128, 2, 4096, 0.1, 0.0),
    (2, 64, 4, 64, 4, 512, 0.0, 0.0),
    (6, 192, 6, 512, 1, 2048, 0.1, 0.1),
    (3, 384, 6, 128, 8, 8192, 0.0, 0.0),
]


def check(layers, hidden, heads, seq, batch, vocab, hidden_dropout, attention_dropout) -> dict:
    config = DominoConfig()
    config.model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                               vocab_size=vocab, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                               make_vocab_size_divisible_by=1)
    forward, peak = measure_training_memory(config.model, vocab, batch)
    est = estimate_layout(config, Layout(micro_batch_size=batch, zero_stage=0), device="cpu")
    est_forward = est.activations + est.logits + est.buffers
    return {"config": f"L{layers} h{hidden} a{heads} s{seq} b{batch} V{vocab} drop {hidden_dropout}/{attention_dropout}",
            "forward_mib": forward / 2**20, "forward_est_mib": est_forward / 2**20,
            "forward_error": est_forward / forward - 1, "peak_mib": peak / 2**20,
            "peak_est_mib": est.total / 2**20, "peak_error": est.total / peak - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [check(*c) for c in CONFIGS]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'config':44s} {'fwd MiB':>8s} {'est':>8s} {'err':>7s} {'peak MiB':>9s} {'est':>8s} {'err':>7s}")
    for r in rows:
        print(f"{r['config']:44s} {r['forward_mib']:8.2f} {r['forward_est_mib']:8.2f} {r['forward_error']:+7.1%} "
              f"{r['peak_mib']:9.2f} {r['peak_est_mib']:8.2f} {r['peak_error']:+7.1%}")
    worst = max(max(abs(r["forward_error"]), abs(r["peak_error"])) for r in rows)
    print(f"largest error: {worst:.1%}")


if __name__ == "__main__":
    main()
