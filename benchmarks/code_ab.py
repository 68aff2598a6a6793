"""Same-run A/B of two trees of the code: the training step's forward and backward, before and after a change.

Both trees run in one process, step by step: the "before" tree's ``domino`` package is copied under the name
``domino_before`` (its ``domino`` imports renamed), both build the same model with the same weights, and the
steps alternate ABBA, so the two see the same background load and the same warm caches; the ratio is the median
over pairs of after / before, each pair back to back, which cancels slow drift of a shared machine's load.

Shapes: ``step`` is ``benchmarks/model_step.py``'s GPT (4 layers, hidden 256, 4 heads, sequence 256, micro-batch
8, vocabulary 8192, fp32, no dropout), where the GEMMs dominate; ``tiny`` is 2 layers of width 32 on 4 x 8 tokens,
where what the Python around the kernels costs shows. Forward + backward only (no optimizer step), at TP=1, for
the synchronous stack and for Domino with 2 chunks.

Usage (the "before" tree from git; the "after" tree is this checkout)::

    mkdir /tmp/before && git archive <base commit> domino | tar -x -C /tmp/before
    python benchmarks/code_ab.py --before /tmp/before [--shape step|tiny] [--pairs 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {
    "step": (dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256), 8, 8192),
    "tiny": (dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8), 4, 64),
}


def _renamed_copy(tree: str, into: str) -> None:
    """``tree/domino`` copied as ``into/domino_before``, every reference to the ``domino`` package renamed."""
    target = os.path.join(into, "domino_before")
    shutil.copytree(os.path.join(tree, "domino"), target)
    for folder, _, files in os.walk(target):
        for name in (n for n in files if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            text = re.sub(r"\bdomino\.(?=[a-z_])", "domino_before.", text)
            text = re.sub(r"^(\s*)from domino import", r"\1from domino_before import", text, flags=re.M)
            text = re.sub(r"^(\s*)import domino$", r"\1import domino_before as domino", text, flags=re.M)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)


def _model(package: str, config_fields: dict, vocab: int, chunks: int, state=None):
    config = importlib.import_module(f"{package}.config").ModelConfig(
        **config_fields, hidden_dropout=0.0, attention_dropout=0.0)
    model = importlib.import_module(f"{package}.model").GPTModel(config, vocab)
    if state is not None:
        model.load_state_dict(state)
    return importlib.import_module(f"{package}.overlap.schedule").apply_domino(model, chunks)


def _timed_step(model, tokens, labels) -> float:
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(tokens, labels=labels).mean().backward()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--before", required=True, help="a tree holding the domino package before the change")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="step")
    parser.add_argument("--pairs", type=int, default=20, help="ABBA rounds per stack (each gives two pairs)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, HERE)
    scratch = tempfile.mkdtemp(prefix="code_ab_")
    try:
        _renamed_copy(args.before, scratch)
        sys.path.insert(0, scratch)
        fields, batch, vocab = SHAPES[args.shape]
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (batch, fields["seq_length"]), generator=g)
        labels = torch.randint(0, vocab, (batch, fields["seq_length"]), generator=g)
        load = os.getloadavg()[0]
        print(f"shape {args.shape}, {args.threads} thread(s), load average {load:.2f}")
        for stack, chunks in (("sync", 1), ("domino2", 2)):
            torch.manual_seed(0)
            after = _model("domino", fields, vocab, chunks)
            before = _model("domino_before", fields, vocab, chunks, after.state_dict())
            times = {"before": [], "after": []}
            for _ in range(args.warmup):
                _timed_step(before, tokens, labels), _timed_step(after, tokens, labels)
            for _ in range(args.pairs):
                for side, model in (("before", before), ("after", after), ("after", after), ("before", before)):
                    times[side].append(_timed_step(model, tokens, labels))
            ratios = [a / b for a, b in zip(times["after"], times["before"])]
            print(f"{stack}: before median {statistics.median(times['before']) * 1e3:.2f} ms "
                  f"(best {min(times['before']) * 1e3:.2f}), after median {statistics.median(times['after']) * 1e3:.2f}"
                  f" ms (best {min(times['after']) * 1e3:.2f}); after/before: paired median "
                  f"{statistics.median(ratios):.3f}, quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-"
                  f"{statistics.quantiles(ratios, n=4)[2]:.3f} over {len(ratios)} pairs")
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
