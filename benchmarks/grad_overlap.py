"""Exposed data-parallel gradient reduction per step under pipeline stages, with and without
``--overlap-grad-reduce`` (:mod:`domino.pipeline.grad_overlap`), PP 2 x DP 2 on four gloo processes.

``DOMINO_SIMULATED_NETWORK`` emulates only the tensor-parallel collectives (:mod:`domino.runtime.network_emulator`:
"Data-parallel (ZeRO) collectives ... are not emulated"), so this benchmark puts the same
:class:`~domino.runtime.network_emulator.LinkEmulator` on the data-parallel all-reduces itself: each completes no
earlier than its launch (or the link's previous collective's end) plus ``latency + 2 (n-1)/n x bytes / B``; the
rest is slept where the step waits for it. Exposed DP time is what a step spends after the schedule's last backward
until the gradients are the replicas' mean (tied-embedding sum included, the same in both):

* without: :func:`domino.pipeline.gradients.sync_tied_embeddings` then
  :func:`domino.train.pipeline_step.average_over_data_parallel` over every gradient, as ``PipelineStep`` does;
* with: :meth:`~domino.pipeline.grad_overlap.OverlappedGradReduce.finish` (waits for the buckets the backward
  launched), the tied sum, and the tied copy's own DP mean (left out of the buckets).

    python benchmarks/grad_overlap.py [--link latency_us=50,gbps=0.1] [--steps 5] [--bucket 60000]
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

VOCAB, SEQ, MICRO, HIDDEN, LAYERS = 512, 64, 2, 64, 8


def _rank(rank, world, port, micro_batches, steps, link, bucket, out):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from domino.config import ModelConfig
    from domino.model import GPTModel
    from domino.pipeline import grad_overlap
    from domino.pipeline.gradients import sync_tied_embeddings, tied_embedding_weight
    from domino.pipeline.schedule import StageSchedule
    from domino.pipeline.stages import split_model
    from domino.runtime import state
    from domino.runtime.network_emulator import LinkEmulator, all_reduce_wire_bytes, parse_spec
    from domino.train import pipeline_step

    mesh = state.initialize_model_parallel(1, pipeline_model_parallel_size=2)
    emulator = LinkEmulator(parse_spec(link))
    dp_group, dp = mesh.dp.process_group, mesh.dp.size
    real_all_reduce = dist.all_reduce

    def emulated_all_reduce(tensor, group=None, async_op=False, **kwargs):
        """gloo's all-reduce, completing no earlier than the emulated link would (DP group only)."""
        if group is not dp_group:
            return real_all_reduce(tensor, group=group, async_op=async_op, **kwargs)
        due = emulator.launch(all_reduce_wire_bytes(tensor.numel() * tensor.element_size(), dp))
        work = real_all_reduce(tensor, group=group, async_op=async_op, **kwargs)
        if not async_op:
            emulator.wait_until(due)
            return work

        class _Emulated:
            def wait(self):
                work.wait()  # gloo's transfer, then what remains of the link's time
                emulator.wait_until(due)
                return True
        return _Emulated()

    dist.all_reduce = emulated_all_reduce
    torch.manual_seed(0)
    config = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                         max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    model = split_model(GPTModel(config, VOCAB), mesh.pp.rank, 2, 1)
    g = torch.Generator().manual_seed(mesh.dp.rank)
    b = MICRO * micro_batches
    tokens, labels = (torch.randint(0, VOCAB, (b, SEQ), generator=g) for _ in range(2))
    mask = torch.ones(b, SEQ)
    tied = tied_embedding_weight(model, mesh)
    result = {}
    for mode in ("without", "with", "without", "with"):  # alternated: the machine's load drifts
        overlap = (grad_overlap.OverlappedGradReduce(list(model.parameters()), mesh.dp, exclude=tied,
                                                     bucket_elements=bucket) if mode == "with" else None)
        schedule = StageSchedule(model, mesh.pp, num_microbatches=micro_batches, micro_batch_size=MICRO, seq_length=SEQ,
                                 hidden_size=HIDDEN, scale_grads=overlap is None)
        exposed, steps_s = [], []
        for n in range(steps + 1):  # the first step warms up
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            if overlap is not None:
                overlap.begin(micro_batches)
            schedule.train_step(tokens, labels, mask)
            after_backward = time.perf_counter()
            if overlap is not None:
                overlap.finish()
                sync_tied_embeddings(model, mesh)
                pipeline_step.average_over_data_parallel([tied.grad] if tied is not None else [], mesh)
            else:
                sync_tied_embeddings(model, mesh)
                pipeline_step.average_over_data_parallel([p.grad for p in model.parameters() if p.grad is not None],
                                                         mesh)
            end = time.perf_counter()
            if n:
                exposed.append(end - after_backward)
                steps_s.append(end - start)
        if overlap is not None:
            overlap.remove()
        result.setdefault(mode, {"exposed": [], "step": []})
        result[mode]["exposed"] += exposed
        result[mode]["step"] += steps_s
        result["buckets"] = len(overlap.buckets) if overlap is not None else result.get("buckets")
    result["grad_elements"] = sum(p.numel() for p in model.parameters())
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", default="latency_us=50,gbps=0.1", help="the emulated DP link")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket", type=int, default=60000, help="elements per bucket")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(4, port, args.micro_batches, args.steps, args.link, args.bucket, out), nprocs=4,
                 join=True)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(4)]
    print(f"PP 2 x DP 2, {LAYERS} layers of width {HIDDEN}, vocab {VOCAB}, seq {SEQ}, {args.micro_batches} "
          f"micro-batches of {MICRO}; DP link {args.link}; {args.steps} steps x 2 per mode; median over steps")
    print("| rank (stage) | grad elements | buckets | exposed DP without (ms) | with (ms) | ratio | step without (ms)"
          " | step with (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r, res in enumerate(ranks):
        e0, e1 = (statistics.median(res[m]["exposed"]) * 1e3 for m in ("without", "with"))
        s0, s1 = (statistics.median(res[m]["step"]) * 1e3 for m in ("without", "with"))
        print(f"| {r} ({r // 2}) | {res['grad_elements']} | {res['buckets']} | {e0:.1f} | {e1:.1f} | "
              f"{e1 / e0:.2f} | {s0:.1f} | {s1:.1f} |")


if __name__ == "__main__":
    main()
