"""The pipeline bubble of 1F1B and interleaved 1F1B: the formula, torch's schedules replayed, and domino measured.

For PP = 2 and 4 and m = 4, 8, 16 micro-batches per step it prints the share of a step each stage idles:

* **formula**: ``(p - 1) / (m + p - 1)`` for 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved with ``v`` = 2 chunks
  per stage (:func:`domino.config.pipeline_schedule.bubble_fraction`; Narayanan et al. 2021, sections 2.2.1-2.2.2);
* **schedule**: the order of forwards and backwards each rank runs in torch 2.13 (``Schedule1F1B._step_microbatches``:
  ``min(m, p - r)`` warm-up forwards, then backward-forward pairs, then the cool-down's backwards; for
  ``ScheduleInterleaved1F1B`` its ``pipeline_order``, the table its runtime executes), replayed with a forward of
  one chunk taking 1 time unit, its backward 2 (Megatron's assumption t_b = 2 t_f) and communication none: what
  the order alone costs, against the formula's ideal;
* **measured** (``--measure``, at the PP sizes of ``--measure-stages``, default 2: two processes are what the
  2-core development machine holds without ranks waiting for a core; ``--measure-stages 2 4`` adds PP 4 on 4
  processes, for a machine with a core per process): a tiny GPT of ``p v`` layers (4 at PP 2, 8 at PP 4: one
  layer per virtual stage, two per 1F1B stage, whatever p) on gloo processes (one thread each), 1F1B through
  domino's :class:`domino.pipeline.schedule.StageSchedule` (torch's ``Schedule1F1B``), interleaved through the
  same class over the same model cut by :func:`domino.pipeline.stages.split_model` into ``p v`` virtual stages
  (torch's ``ScheduleInterleaved1F1B``), chunk ``c`` of rank ``r`` being virtual stage ``c p + r``; per rank
  ``1 - busy / step`` where busy is the time inside the stages' ``forward_one_chunk`` and ``backward_one_chunk``
  (torch's per-micro-batch compute; the waits for point-to-point transfers are outside them), the mean over ranks
  and the timed steps.

    python benchmarks/pipeline_bubble.py [--measure] [--measure-stages 2 [4]] [--steps 3] [--json]
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
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from domino.config.pipeline_schedule import bubble_fraction  # noqa: E402

STAGES, MICROBATCHES, CHUNKS = (2, 4), (4, 8, 16), 2
FORWARD, BACKWARD = 1.0, 2.0  # time units of one chunk's forward and backward in the replay
HIDDEN, HEADS, SEQ, MICRO, VOCAB = 256, 4, 128, 2, 512  # the measured model; p x CHUNKS layers at PP p


def one_f_one_b_order(p: int, m: int, rank: int) -> List[Tuple[str, int, int]]:
    """Rank ``rank``'s (kind, stage, micro-batch) in torch's ``Schedule1F1B._step_microbatches``."""
    warmup = min(m, p - rank)
    ops = [("F", rank, j) for j in range(warmup)]
    forward = warmup
    for backward in range(m):
        ops.append(("B", rank, backward))
        if forward < m:
            ops.append(("F", rank, forward))
            forward += 1
    return ops


def interleaved_order(p: int, m: int, v: int) -> List[List[Tuple[str, int, int]]]:
    """Per rank, (kind, virtual stage, micro-batch) in the ``pipeline_order`` of torch's ScheduleInterleaved1F1B."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    rows = get_schedule_ops("Interleaved1F1B", p, m, num_stages_per_rank=v)
    return [[("F" if a.computation_type.name == "FORWARD" else "B", a.stage_index, a.microbatch_index)
             for a in row if a is not None] for row in rows]


def replay(orders: List[List[Tuple[str, int, int]]], num_stages: int) -> float:
    """Runs each rank's ops in order as soon as their inputs exist (F of stage s after F of s - 1; B of s after
    F of s and B of s + 1); returns the mean over ranks of the idle share of the span."""
    done: Dict[Tuple[str, int, int], float] = {}
    clock, position = [0.0] * len(orders), [0] * len(orders)
    while any(position[r] < len(orders[r]) for r in range(len(orders))):
        progressed = False
        for r, ops in enumerate(orders):
            while position[r] < len(ops):
                kind, stage, mb = ops[position[r]]
                needs = [("F", stage - 1, mb)] if kind == "F" and stage > 0 else []
                if kind == "B":
                    needs = [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < num_stages - 1 else [])
                if not all(n in done for n in needs):
                    break
                start = max([clock[r]] + [done[n] for n in needs])
                clock[r] = done[(kind, stage, mb)] = start + (FORWARD if kind == "F" else BACKWARD)
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocks")
    span = max(clock)
    busy = [sum(FORWARD if k == "F" else BACKWARD for k, _, _ in ops) for ops in orders]
    return statistics.mean(1 - b / span for b in busy)


def _stages(rank: int, world: int, m: int, chunks: int):
    """``(stages to time, run one step)`` for this rank: domino's StageSchedule over this rank's stage (1F1B) or,
    with ``chunks`` > 1, over its ``chunks`` virtual stages of the same model (interleaved 1F1B)."""
    import torch

    from domino.config import ModelConfig
    from domino.model import GPTModel
    from domino.pipeline.schedule import StageSchedule
    from domino.pipeline.stages import split_model
    from domino.runtime import state

    torch.manual_seed(0)
    config = ModelConfig(num_layers=world * CHUNKS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                         hidden_dropout=0.0, attention_dropout=0.0)
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, VOCAB, (m * MICRO, SEQ), generator=g) for _ in range(2))
    mask = torch.ones(m * MICRO, SEQ)
    pipeline = StageSchedule(split_model(GPTModel(config, VOCAB), rank, world, chunks),
                             state.current_mesh().pp, num_microbatches=m, micro_batch_size=MICRO, seq_length=SEQ,
                             hidden_size=HIDDEN)
    return pipeline.stages, lambda: pipeline.train_step(tokens, labels, mask)


def time_stage_compute(stages) -> List[float]:
    """Times torch's per-micro-batch compute of ``stages`` (their ``forward_one_chunk`` and ``backward_one_chunk``,
    wrapped): returns a one-element list that those calls add their seconds to (reset it between steps). The waits
    for the pipeline's point-to-point transfers happen outside them."""
    busy = [0.0]
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            inner = getattr(stage, name)

            def timed(*args, _inner=inner, **kwargs):
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - start

            setattr(stage, name, timed)
    return busy


def _measure_rank(rank: int, world: int, port: int, m: int, chunks: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from domino.runtime import state

    state.initialize_model_parallel(1, pipeline_model_parallel_size=world)
    stages, step = _stages(rank, world, m, chunks)
    busy = time_stage_compute(stages)
    shares = []
    for n in range(steps + 1):  # the first step warms up (allocations, gloo pairs)
        dist.barrier()
        busy[0], start = 0.0, time.perf_counter()
        step()
        dist.barrier()
        wall = time.perf_counter() - start
        if n:
            shares.append(1 - busy[0] / wall)
    torch.save(shares, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure(p: int, m: int, chunks: int, steps: int) -> float:
    """Mean over ranks and timed steps of the measured idle share (see the module doc)."""
    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_measure_rank, args=(p, port, m, chunks, steps, out), nprocs=p, join=True)
        return statistics.mean(x for r in range(p) for x in torch.load(os.path.join(out, f"rank{r}.pt")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measure", action="store_true", help="also measure domino's 1F1B on gloo processes")
    parser.add_argument("--measure-stages", type=int, nargs="+", default=[2], choices=STAGES,
                        help="PP sizes --measure runs, each on that many processes (default 2; see the module doc)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measured setting (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rows = []
    for p in STAGES:
        for m in MICROBATCHES:
            row = {"pp": p, "micro_batches": m,
                   "1f1b_formula": bubble_fraction(p, m),
                   "1f1b_schedule": replay([one_f_one_b_order(p, m, r) for r in range(p)], p),
                   "interleaved_formula": bubble_fraction(p, m, CHUNKS),
                   "interleaved_schedule": replay(interleaved_order(p, m, CHUNKS), p * CHUNKS)}
            if args.measure and p in args.measure_stages:
                row["1f1b_measured"] = measure(p, m, 1, args.steps)
                row["interleaved_measured"] = measure(p, m, CHUNKS, args.steps)
            rows.append(row)
    if args.json:
        print(json.dumps({"chunks_per_stage": CHUNKS, "cores": os.cpu_count(), "load_average": os.getloadavg(),
                          "rows": rows}, indent=2))
        return
    if args.measure:
        print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end of the measurements")
    columns = ["1f1b_formula", "1f1b_schedule"] + (["1f1b_measured"] if args.measure else []) + [
        "interleaved_formula", "interleaved_schedule"] + (["interleaved_measured"] if args.measure else [])
    print("| PP | m | " + " | ".join(c.replace("1f1b", "1F1B").replace("interleaved", f"interleaved v={CHUNKS}")
                                    .replace("_", " ") for c in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row[c]:.3f}" if c in row else "-" for c in columns]
        print(f"| {row['pp']} | {row['micro_batches']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
