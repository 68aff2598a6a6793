"""What an (asynchronous) save's snapshot blocks the training thread for: the optimizer state gathered whole over
data parallelism (DeepSpeed's ``safe_get_full_*``, the way before ``fragment_io``) vs each rank copying its own
ZeRO fragments (:func:`domino.optim.state.local_fragments`), on a state of >= 1 GB.

Two gloo processes, DP 2 x ZeRO-1, a GPT of 2 layers at hidden 2048 (vocabulary 8192): 117 M parameters, so the
fp32 master weights and both Adam moments are 1.41 GB across the two ranks. Adam's state is created as a resume
does (``optimizer_state.prepare``), so both paths read every moment. Each repeat times, on each rank, the gather
as checkpoints used it (every parameter's three tensors all-reduced over DP, every other one kept, as the replicas
shared the writing) and the fragment copy, alternating which goes first; both copy what they keep to the host with
the asynchronous saver's ``host_copy``. The figure per repeat is the slower rank's (the step waits for it).

    python benchmarks/snapshot.py [--repeats 3] [--hidden 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _rank(rank: int, world: int, port: int, hidden: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from domino.checkpoint.async_save import host_copy
    from domino.config import parse_config
    from domino.runtime.mesh import collective_device
    from domino.optim import state as optimizer_state
    from domino.optim.deepspeed_optimizer import build_deepspeed_optimizer
    from domino.train import runtime_start
    from domino.train.gpt_recipe import GPTRecipe

    config = parse_config(["--num-layers", "2", "--hidden-size", str(hidden), "--num-attention-heads", "16",
                           "--vocab-size", "8192", "--seq-length", "64", "--max-position-embeddings", "64",
                           "--micro-batch-size", "1", "--global-batch-size", str(world), "--mock-data",
                           "--zero-stage", "1", "--train-iters", "1"], world_size=world)
    mesh = runtime_start.initialize_runtime(config)
    recipe = GPTRecipe(config, mesh)
    with collective_device(mesh.tp.process_group):
        model = recipe.model_builder(config, mesh)
    engine = build_deepspeed_optimizer(model, config, mesh)
    optimizer_state.prepare(engine, optimizer_state.Scalars(step=1))  # Adam's state, as after a step or a resume
    params = sum(p.numel() for p in engine.module.parameters())
    dp, dp_rank = mesh.dp_cp.size, mesh.dp_cp.rank

    def gathered():
        tensors, _ = optimizer_state.gather(engine, keep=lambda i: i % dp == dp_rank, to_host=host_copy)
        return sum(t.numel() * 4 for t in tensors.values())

    def fragments():
        held, _ = optimizer_state.local_fragments(engine, to_host=host_copy)
        return sum(f.data.numel() * 4 for f in held.values())

    times = {"gather": [], "fragments": []}
    kept = {}
    for repeat in range(repeats):
        order = [("gather", gathered), ("fragments", fragments)]
        for name, fn in (order if repeat % 2 == 0 else order[::-1]):
            dist.barrier()
            began = time.perf_counter()
            kept[name] = fn()
            seconds = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank's: the step waits for it
            times[name].append(float(seconds))
    if rank == 0:
        Path(out).write_text(json.dumps({"parameters": params, "state_bytes": params * 12, "times": times,
                                         "kept_bytes_rank0": kept}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(_rank, args=(2, port, args.hidden, args.repeats, out), nprocs=2, join=True)
        result = json.loads(Path(out).read_text())
    if args.json:
        print(json.dumps(result))
        return
    times = result["times"]
    print(f"{result['parameters'] / 1e6:.0f} M parameters, optimizer state {result['state_bytes'] / 1e9:.2f} GB "
          f"(fp32 master + 2 moments), DP 2 x ZeRO-1, 2 gloo processes; slower rank's blocking time, s")
    print("| snapshot of the optimizer state | " + " | ".join(f"repeat {i + 1}" for i in range(len(times["gather"])))
          + " | median | host bytes kept, rank 0 |")
    print("|---|" + "---|" * (len(times["gather"]) + 2))
    for name, label in (("gather", "gathered whole over DP (safe_get_full_*)"),
                        ("fragments", "own ZeRO fragments (local_fragments)")):
        print(f"| {label} | " + " | ".join(f"{t:.2f}" for t in times[name]) +
              f" | {statistics.median(times[name]):.2f} | {result['kept_bytes_rank0'][name] / 1e6:.0f} MB |")
    ratio = statistics.median(times["gather"]) / statistics.median(times["fragments"])
    print(f"\ngather / fragments (medians): {ratio:.1f}x")


if __name__ == "__main__":
    main()
