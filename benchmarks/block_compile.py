"""CPU A/B of ``DOMINO_KERNELS=compiled`` (each block compiled whole by inductor) against the eager CPU choice.

Full training steps (forward, backward, fused AdamW; fp32) of one ``GPTModel`` at TP=1, 4 layers, hidden 256,
4 heads, sequence 256, micro-batch 8, vocabulary 8192 (``benchmarks/model_step.py``'s shape). The same model and
batch run both ways, alternating step by step after warm-up (the compile happens in warm-up); the ratio is the
median of back-to-back pairs, which cancels slow load drift on a shared machine. CPU only: nothing here says
what the compiled block does on a GPU.

Usage::

    flock /work/bench.lock python benchmarks/block_compile.py [--repeats 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from domino.config.schema import ModelConfig
from domino.model import GPTModel
from domino.parallel.kernels import CPU_KERNELS, BLOCK_BACKEND, apply_kernels

SHAPE = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256, max_position_embeddings=256,
             hidden_dropout=0.0, attention_dropout=0.0)
VOCAB, BATCH = 8192, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(**SHAPE), VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SHAPE["seq_length"]))
    labels = torch.randint(0, VOCAB, (BATCH, SHAPE["seq_length"]))
    choices = {"eager": CPU_KERNELS, "compiled": dataclasses.replace(CPU_KERNELS, compile_blocks=BLOCK_BACKEND)}

    def step(kernels) -> float:
        start = time.perf_counter()
        apply_kernels(model, kernels)
        model(tokens, labels=labels).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    compile_s = step(choices["compiled"])  # traces and builds the block's forward and backward
    for _ in range(2):
        for kernels in choices.values():
            step(kernels)
    times = {name: [] for name in choices}
    for _ in range(args.repeats):
        for name, kernels in choices.items():
            times[name].append(step(kernels))
    tokens_per_step = BATCH * SHAPE["seq_length"]
    for name, ts in times.items():
        print(f"{name:9s} {tokens_per_step / statistics.median(ts):8.0f} tokens/s (median of {len(ts)})")
    ratio = statistics.median(e / c for e, c in zip(times["eager"], times["compiled"]))
    print(f"compiled/eager speed: {ratio:.3f}x (median of back-to-back pairs); first compiled step {compile_s:.1f} s")


if __name__ == "__main__":
    main()
