"""What ``--log-straggler`` costs: its all-gather per log interval against a step of the tiny preset.

Two gloo ranks on loopback time :meth:`domino.train.stragglers.StragglerDetector.measure` (the whole per-interval
work: the gather on its own group and the rule) over many calls, and the same ranks time a TP 2 training step of
the ``tiny`` preset's shape as forward + backward of an all-reduced MLP-sized matmul (for scale only). Prints a
JSON line: microseconds per measure, milliseconds per step, and the overhead at --log-interval 1 (the worst case).

    python benchmarks/stragglers.py [--calls 500]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, calls: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from domino.train.stragglers import StragglerDetector

    detector = StragglerDetector(True, ["localhost"] * world, timeout_minutes=1)
    for _ in range(20):
        detector.measure(1.0, 0.1, 10)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        detector.measure(1.0, 0.1, 10)
    measure_us = (time.perf_counter() - started) / calls * 1e6
    x, w = torch.randn(4 * 256, 128, requires_grad=True), torch.randn(128, 512, requires_grad=True)
    steps = 50
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):  # a stand-in for the tiny preset's step: a matmul, its all-reduce, backward
        y = x @ w
        dist.all_reduce(y.detach())
        y.sum().backward()
    step_ms = (time.perf_counter() - started) / steps * 1e3
    if rank == 0:
        out.put({"measure_us": round(measure_us, 1), "step_ms_stand_in": round(step_ms, 2),
                 "overhead_at_log_interval_1": round(measure_us / 1e3 / step_ms, 5)})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(2, port, args.calls, queue), nprocs=2)
    print(json.dumps(queue.get()))


if __name__ == "__main__":
    main()
