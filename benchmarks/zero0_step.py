"""The ZeRO 0 training step: DeepSpeed's engine against domino's own (``domino/optim/torch_optimizer.py``, and
``domino/optim/mixed_precision.py`` with ``--bf16``).

fp32: both run the same arithmetic (bit for bit, ``tests/train/test_torch_optimizer.py``): the loss divided by the
accumulation steps, the replicas' gradients summed and scaled by 1/DP, domino's clipping, torch's fused AdamW. They
differ in where the data-parallel reduction happens: DeepSpeed 0.19.8's engine flattens every gradient into one
buffer after the backward, all-reduces it and copies it back (``allreduce_gradients`` ->
``buffered_allreduce_fallback``); domino's gradients are views into buckets whose all-reduce the backward launches
as each bucket's last gradient is final, in place.

``--bf16``: DeepSpeed's bf16 path at ZeRO 1 (its ``BF16_Optimizer`` with domino's device-decided step: the fp32
gradient sums of every bf16 gradient, reduced after the backward, fp32 master partitions) against domino's
``MixedPrecisionAdamW`` at ZeRO 0 (fp32 main gradients in buckets reduced from the backward, fp32 masters, torch's
fused AdamW): bit for bit equal (``tests/train/test_mixed_precision.py``). bf16 matmuls are slow on CPU: keep the
model small.

Two gloo processes (DP 2), a GPT of ``--layers`` layers at ``--hidden`` (fp32, no dropout), two micro-batches per
step; the two optimizers step in turn, the order alternating per repeat, each timed over ``--steps`` steps after
a warm-up step; the figure is the slower rank's median step time (the step waits for it).

    python benchmarks/zero0_step.py [--repeats 5] [--steps 5] [--hidden 512] [--layers 4] [--bucket-elements N]
        [--bf16] [--json]
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


def _rank(rank: int, world: int, port: int, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from domino.config import parse_config
    from domino.model import GPTModel
    from domino.optim.deepspeed_optimizer import build_deepspeed_optimizer
    from domino.optim.grad_buffer import GradBuckets
    from domino.optim.torch_optimizer import build_torch_optimizer
    from domino.train import runtime_start

    seq, vocab = 128, 4096

    def parsed(stage: str):
        return parse_config(["--num-layers", str(args["layers"]), "--hidden-size", str(args["hidden"]),
                             "--num-attention-heads", "8", "--seq-length", str(seq), "--max-position-embeddings",
                             str(seq), "--vocab-size", str(vocab), "--mock-data", "--micro-batch-size", "1",
                             "--global-batch-size", "4", "--zero-stage", stage, "--clip-grad", "1.0",
                             "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "1",
                             *(["--bf16"] if args["bf16"] else [])], world_size=world)

    # DeepSpeed's bf16 optimizers need ZeRO 1 (their BF16_Optimizer); fp32 compares ZeRO 0 with ZeRO 0.
    configs = {"deepspeed": parsed("1" if args["bf16"] else "0"), "domino": parsed("0")}
    mesh = runtime_start.initialize_runtime(configs["domino"])
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (1, seq + 1), generator=g) for _ in range(2)]
    builders = {"deepspeed": build_deepspeed_optimizer, "domino": build_torch_optimizer}
    optimizers = {}
    for name, build in builders.items():
        torch.manual_seed(1)
        optimizers[name] = build(GPTModel(configs[name].model, vocab, tp=mesh.tp), configs[name], mesh)
    if args["bucket_elements"]:  # Megatron's default bucket (40 M elements) holds this whole model: cut smaller
        domino = optimizers["domino"]
        domino.grads.remove()
        domino.grads = GradBuckets(list(domino.module.parameters()), mesh.dp, mesh.dp_cp,
                                   bucket_elements=args["bucket_elements"])
        for param, master in getattr(domino, "masters", {}).items():
            master.grad = param.main_grad  # bf16: the masters' gradients are the new buckets' views

    def step(optimizer) -> None:
        for _, batch in zip(optimizer.micro_batches(4, 2), batches):
            optimizer.backward(optimizer.forward_model(batch[:, :-1], labels=batch[:, 1:]).float().mean())
        optimizer.step()

    times = {name: [] for name in builders}
    for repeat in range(args["repeats"]):
        names = list(builders) if repeat % 2 == 0 else list(builders)[::-1]
        for name in names:
            step(optimizers[name])  # warm-up
            dist.barrier()
            began = time.perf_counter()
            for _ in range(args["steps"]):
                step(optimizers[name])
            seconds = torch.tensor([(time.perf_counter() - began) / args["steps"]], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slower rank's: the step waits for it
            times[name].append(float(seconds))
    if rank == 0:
        params = sum(p.numel() for p in optimizers["domino"].module.parameters())
        Path(out).write_text(json.dumps({"parameters": params, "times": times,
                                         "buckets": len(optimizers["domino"].grads.buckets),
                                         "load": os.getloadavg()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-elements", type=int, default=1_000_000,
                        help="domino's bucket size (0: Megatron's default, one bucket for a model this small)")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights: DeepSpeed's bf16 ZeRO 1 against "
                        "domino's fp32 masters and main gradients at ZeRO 0")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(_rank, args=(2, port, vars(args), out), nprocs=2, join=True)
        result = json.loads(Path(out).read_text())
    result["load_before"] = load_before
    if args.json:
        print(json.dumps(result))
        return
    times = result["times"]
    precision = "bf16 (DeepSpeed at ZeRO 1)" if args.bf16 else "fp32"
    print(f"{result['parameters'] / 1e6:.1f} M parameters, DP 2 x ZeRO 0 {precision}, 2 gloo processes, 2 micro-batches "
          f"per step; slower rank's seconds per step (load {load_before[0]:.1f} -> {result['load'][0]:.1f})")
    print("| step | " + " | ".join(f"repeat {i + 1}" for i in range(len(times["domino"]))) + " | median |")
    print("|---|" + "---|" * (len(times["domino"]) + 1))
    for name, label in (("deepspeed", "DeepSpeed's engine (reduce after the backward)"),
                        ("domino", f"domino's {'MixedPrecisionAdamW' if args.bf16 else 'TorchAdamW'} ({result['buckets']} "
                                  "buckets reduced from the backward)")):
        print(f"| {label} | " + " | ".join(f"{t:.3f}" for t in times[name]) +
              f" | {statistics.median(times[name]):.3f} |")
    ratio = statistics.median(times["deepspeed"]) / statistics.median(times["domino"])
    print(f"\ndeepspeed / domino (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
