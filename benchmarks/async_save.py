"""What a checkpoint save costs the training, synchronous vs ``--async-save``, on a model of >= 100 MB of state.

One process trains a GPT (4 layers, hidden 384, vocabulary 8192: 10.3 M parameters, so a checkpoint holds
165 MB: the fp32 weights, and the fp32 master weights and both Adam moments) in the same process, with the same
data, without saving, with a synchronous save every ``--save-at`` iterations and with ``--async-save``, the
three modes interleaved per repeat. A wrapper around the forward step notes when every iteration starts, so
the time between two starts is one iteration as the training loop lived it: the save's work on the training
thread and any slowdown from the background writer (a second core's work, here competing for the same two)
included. The cost of one save is the time of the iterations from the first save to the one before the last
(the last holds the final save) minus the same iterations without saving, divided by the saves among them;
"on the training thread" is the part of it spent inside the saver (``save``, ``poll``, ``wait``).

    python benchmarks/async_save.py [--iters 13] [--save-at 4] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

MODEL = ["--num-layers", "4", "--hidden-size", "384", "--num-attention-heads", "6", "--vocab-size", "8192",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2"]


def _train(config_args: List[str], iters: int, save_at: Optional[int], mode: str, folder: Path) -> Dict:
    from domino.checkpoint import async_save
    from domino.config import parse_config
    from domino.train.gpt_recipe import GPTRecipe
    from domino.runtime.state import current_mesh
    from domino.train.pretrain import pretrain

    args = [*config_args, "--train-iters", str(iters)]
    if save_at is not None:
        args += ["--save", str(folder / mode), "--save-interval", str(save_at)]
        if mode == "async":
            args.append("--async-save")
    config = parse_config(args)
    mesh = current_mesh()  # the one main's initialize_runtime built for every run of this process
    recipe = GPTRecipe(config, mesh)
    starts: List[float] = []

    def forward_step(data_iterator, model):
        starts.append(time.perf_counter())
        return recipe.forward_step(data_iterator, model)

    calls: List[tuple] = []  # (start, seconds) of every save/poll/wait call on the training thread
    real = {name: getattr(async_save.AsyncCheckpointSaver, name) for name in ("save", "poll", "wait")}
    real_sync = async_save.CheckpointSaver.save

    def timed(fn):
        def wrapper(*a, **k):
            began = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                calls.append((began, time.perf_counter() - began))
        return wrapper

    for name, fn in real.items():
        setattr(async_save.AsyncCheckpointSaver, name, timed(fn))
    async_save.CheckpointSaver.save = timed(real_sync)
    try:
        pretrain(config, recipe.model_builder, recipe.dataset_builder, forward_step, recipe.padded_vocab_size,
                 mesh=mesh)
    finally:
        for name, fn in real.items():
            setattr(async_save.AsyncCheckpointSaver, name, fn)
        async_save.CheckpointSaver.save = real_sync
    ended = time.perf_counter()
    # Iteration i (1-based) lasts from its forward's start to the next one's (the last: to the loop's end,
    # which includes the final save and, with --async-save, the wait for it: left out below).
    intervals = [b - a for a, b in zip(starts, starts[1:])] + [ended - starts[-1]]
    return {"intervals": intervals, "on_thread_s": sum(s for began, s in calls if began < starts[-1])}


def _state_mb(config_args: List[str]) -> float:
    from domino.config import parse_config
    from domino.runtime.mesh import ParallelMesh
    from domino.train.gpt_recipe import GPTRecipe

    config = parse_config([*config_args, "--train-iters", "1"])
    model = GPTRecipe(config, ParallelMesh.single()).model_builder(config, ParallelMesh.single())
    params = sum(p.numel() for p in model.parameters())
    return params * 4 * 4 / 1e6  # the weights, and the fp32 master weights and both Adam moments


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=13)
    parser.add_argument("--save-at", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    from domino.config import parse_config
    from domino.logging_utils import setup_logging
    from domino.train.runtime_start import initialize_runtime

    setup_logging("warning")
    config_args = ["--preset", "tiny", *MODEL, "--mock-data", "--num-workers", "0", "--seed", "7",
                   "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "1000"]
    initialize_runtime(parse_config([*config_args, "--train-iters", "1"]))
    state_mb = _state_mb(config_args)
    # From the first save's iteration up to the one before the last (the last holds the final save).
    window = slice(args.save_at - 1, args.iters - 1)
    saves = (args.iters - 1) // args.save_at  # the saves inside the window
    rows: Dict[str, List[Dict]] = {"none": [], "sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in rows:
                folder = Path(tmp) / f"r{repeat}"
                run = _train(config_args, args.iters, None if mode == "none" else args.save_at, mode, folder)
                rows[mode].append(run)
    baseline = [sum(r["intervals"][window]) for r in rows["none"]]
    result = {"state_mb": round(state_mb, 1), "iters": args.iters, "save_at": args.save_at, "saves": saves,
              "median_iteration_s": statistics.median(i for r in rows["none"] for i in r["intervals"][1:-1]),
              "modes": {}}
    for mode in ("sync", "async"):
        costs = [(sum(r["intervals"][window]) - b) / saves for r, b in zip(rows[mode], baseline)]
        result["modes"][mode] = {"cost_s": [round(c, 3) for c in costs],
                                 "on_thread_s": [round(r["on_thread_s"] / saves, 3) for r in rows[mode]]}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"state {result['state_mb']} MB, {args.iters} iterations, a save every {args.save_at} ({saves} measured), "
          f"median iteration {result['median_iteration_s']:.3f} s (no save)")
    print("| mode | training time one save cost, s (per repeat) | of it on the training thread, s |")
    print("|---|---:|---:|")
    for mode, m in result["modes"].items():
        print(f"| {mode} | {' / '.join(f'{c:.2f}' for c in m['cost_s'])} | "
              f"{' / '.join(f'{c:.2f}' for c in m['on_thread_s'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
