"""CPU A/B of ``DOMINO_KERNELS=compiled`` against the eager CPU choice: each block compiled whole by inductor at
TP=1; at ``--tp 2`` (two gloo processes, one thread each) each layer's segments between collectives
(:mod:`domino.model.segments`), synchronous or with ``--domino-chunks``.

Full training steps (forward, backward, fused AdamW; fp32) of one ``GPTModel``, 4 layers, hidden 256,
4 heads, sequence 256, micro-batch 8, vocabulary 8192 (``benchmarks/model_step.py``'s shape). The same model and
batch run both ways, alternating step by step after warm-up (the compile happens in warm-up); the ratio is the
median of back-to-back pairs, which cancels slow load drift on a shared machine. CPU only: nothing here says
what the compiled blocks or segments do on a GPU.

Usage::

    flock /work/bench.lock python benchmarks/block_compile.py [--repeats 10] [--threads 2]
                                                              [--tp 2 [--domino-chunks 2]]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from domino.config.schema import ModelConfig  # noqa: E402
from domino.model import GPTModel  # noqa: E402
from domino.overlap.schedule import apply_domino  # noqa: E402
from domino.parallel.kernels import CPU_KERNELS, BLOCK_BACKEND, apply_kernels  # noqa: E402
from domino.runtime import state  # noqa: E402

SHAPE = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256, max_position_embeddings=256,
             hidden_dropout=0.0, attention_dropout=0.0)
VOCAB, BATCH = 8192, 8


def measure(args: argparse.Namespace, rank: int = 0) -> None:
    """Builds the model on this rank (its TP shard at ``--tp 2``), runs the alternation, prints on rank 0."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tp = state.current_mesh().tp if args.tp > 1 else None
    model = apply_domino(GPTModel(ModelConfig(**SHAPE), VOCAB, **({"tp": tp} if tp else {})), args.domino_chunks)
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

    compile_s = step(choices["compiled"])  # traces and builds the blocks' (segments') forward and backward
    for _ in range(2):
        for kernels in choices.values():
            step(kernels)
    times = {name: [] for name in choices}
    for _ in range(args.repeats):
        for name, kernels in choices.items():
            times[name].append(step(kernels))
    if rank:
        return
    tokens_per_step = BATCH * SHAPE["seq_length"]
    print(f"TP={args.tp}, Domino chunks {args.domino_chunks}, {args.threads} thread(s) per process")
    for name, ts in times.items():
        print(f"{name:9s} {tokens_per_step / statistics.median(ts):8.0f} tokens/s (median of {len(ts)})")
    ratio = statistics.median(e / c for e, c in zip(times["eager"], times["compiled"]))
    print(f"compiled/eager speed: {ratio:.3f}x (median of back-to-back pairs); first compiled step {compile_s:.1f} s")


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.tp)
    state.initialize_model_parallel(args.tp)
    try:
        measure(args, rank)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="per process (default 2; 1 at --tp 2)")
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor-parallel size (gloo processes)")
    parser.add_argument("--domino-chunks", type=int, default=1)
    args = parser.parse_args()
    if args.tp == 1:
        measure(args)
        return
    if "--threads" not in sys.argv:
        args.threads = 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=args.tp)


if __name__ == "__main__":
    main()
