"""How close ``domino estimate`` is to measured tensor memory, on small GPT configs on CPU (fp32, TP=1).

For each config, a fresh ``GPTModel`` trains two steps with AdamW under
:class:`~domino.train.memory_probe.LiveTensorBytes` (a dispatch mode counting live tensor storages). Two numbers
are compared with :func:`domino.config.estimate.estimate_layout` (``device="cpu"``):

* **forward**: bytes the first forward adds (activations + logits + the QKV weight copies) vs the estimate's
  ``activations + logits + buffers``;
* **peak**: the most bytes alive over the two steps (weights, AdamW state, activations, gradients) vs ``total``.

A second table does the same for each activation-recompute setting of one config (dropout on): the forward
keeps less, and the peak moves into backward, where one recomputed group is alive at a time.

Memory is deterministic, so one run suffices. Usage::

    python benchmarks/estimate_check.py [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from domino.config import DominoConfig, ModelConfig
from domino.config.estimate import Layout, estimate_layout
from domino.model.recompute import RecomputePlan
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


RECOMPUTE_CONFIG = (4, 128, 4, 256, 4, 1024, 0.1, 0.1)
RECOMPUTE = {"none": None, "selective": RecomputePlan("selective"),
             "full uniform 1": RecomputePlan("full", "uniform", 1), "full uniform 2": RecomputePlan("full", "uniform", 2),
             "full block 2": RecomputePlan("full", "block", 2)}


def check(layers, hidden, heads, seq, batch, vocab, hidden_dropout, attention_dropout, plan=None) -> dict:
    config = DominoConfig()
    config.model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                               vocab_size=vocab, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                               make_vocab_size_divisible_by=1)
    forward, peak = measure_training_memory(config.model, vocab, batch, recompute=plan)
    layout = Layout(micro_batch_size=batch, zero_stage=0)
    if plan is not None:
        layout.recompute = plan.granularity
        layout.recompute_method, layout.recompute_num_layers = plan.method or "uniform", plan.num_layers or 1
    est = estimate_layout(config, layout, device="cpu")
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
    recompute = [dict(check(*RECOMPUTE_CONFIG, plan=plan), config=name) for name, plan in RECOMPUTE.items()]
    if args.json:
        print(json.dumps({"configs": rows, "recompute": recompute}, indent=2))
        return
    _table(rows)
    layers, hidden, heads, seq = RECOMPUTE_CONFIG[:4]
    print(f"\nactivation recompute (peak only: the estimate counts the block recomputed in backward), L{layers} "
          f"h{hidden} a{heads} s{seq} b{RECOMPUTE_CONFIG[4]} V{RECOMPUTE_CONFIG[5]}, dropout 0.1/0.1:")
    _table(recompute, peak_only=True)


def _table(rows, peak_only: bool = False) -> None:
    print(f"{'config':44s} {'fwd MiB':>8s} {'est':>8s} {'err':>7s} {'peak MiB':>9s} {'est':>8s} {'err':>7s}")
    for r in rows:
        forward = ("" if peak_only else f"{r['forward_est_mib']:8.2f} {r['forward_error']:+7.1%}").rjust(16)
        print(f"{r['config']:44s} {r['forward_mib']:8.2f} {forward} "
              f"{r['peak_mib']:9.2f} {r['peak_est_mib']:8.2f} {r['peak_error']:+7.1%}")
    worst = max(max(0 if peak_only else abs(r["forward_error"]), abs(r["peak_error"])) for r in rows)
    print(f"largest error: {worst:.1%}")


if __name__ == "__main__":
    main()
