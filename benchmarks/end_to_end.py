"""End-to-end = model step: `domino pretrain` tokens/s against its own bare model step and a plain PyTorch GPT.

At the shape of ``benchmarks/model_step.py`` (GPT 4L/256h/4 heads, seq 256, micro-batch 8, vocabulary 8192,
fp32, no dropout anywhere), for 1 and 2 threads, in one run:

* ``pretrain`` - ``domino pretrain --mock-data`` (DeepSpeed engine at its default ZeRO stage, 0 with this one
  data-parallel replica; gradient clipping 1.0, the LR schedule, data loading, logging) as a child process;
  tokens/s of its log intervals after the first (warm-up);
* ``model_step`` - the same ``GPTModel`` stepped bare in a fresh child process (:func:`steps_in_child`), steps
  alternating with ``plain``'s: forward with labels, mean, backward, ``torch.optim.AdamW(fused=True)``. The
  child sets the host allocator as ``domino pretrain`` does (``domino/train/host_allocator.py``), so the two
  sides differ only in what pretraining adds to the step; ``model_step_glibc`` is the same child with glibc's
  default allocator, to show what that setting is worth;
* ``plain`` - ``model_step.py``'s plain PyTorch GPT (one fused QKV ``nn.Linear``, SDPA ``is_causal``, tied
  weights, ``F.cross_entropy``, fused AdamW), in the same child as ``model_step``.

Each round measures all of them back to back; ratios are medians over rounds of the per-round ratios. Two
clocks: wall time (tokens/s as a user sees them) and CPU time of the process (its own threads only), which a
loaded shared machine disturbs far less; the load average is printed with the figures. The target: pretrain
within 3% of the model step, and the model step no slower than plain.

    python benchmarks/end_to_end.py [--rounds 3] [--iters 36] [--steps 10] [--threads 1 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import model_step  # noqa: E402  (the shape, the plain GPT and the timed steps)

PRETRAIN = ["--num-layers", str(model_step.LAYERS), "--hidden-size", str(model_step.HIDDEN),
            "--num-attention-heads", str(model_step.HEADS), "--seq-length", str(model_step.SEQ),
            "--max-position-embeddings", str(model_step.SEQ), "--micro-batch-size", str(model_step.BATCH),
            "--mock-data", "--vocab-size", str(model_step.VOCAB), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--lr", "1e-4", "--lr-warmup-iters", "0", "--eval-interval", "0", "--eval-iters", "0",
            "--num-workers", "0", "--log-interval", "6"]
TOKENS = model_step.BATCH * model_step.SEQ
SHORT = 6  # iterations of the start-up-only run whose CPU time is subtracted
KINDS = ("pretrain", "model_step", "model_step_glibc", "plain")


def _child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _pretrain(threads: int, iters: int, work: Path) -> tuple:
    """Runs `domino pretrain` at its defaults; returns (its log records, its CPU seconds)."""
    metrics = work / f"metrics-{threads}-{iters}.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    before = _child_cpu_seconds()
    subprocess.run([sys.executable, "-m", "domino", "pretrain", *PRETRAIN, "--train-iters", str(iters),
                    "--metrics-file", str(metrics)], check=True, env=env,
                   capture_output=True)
    cpu = _child_cpu_seconds() - before
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()], cpu


def pretrain_rates(threads: int, iters: int, work: Path) -> dict:
    """Wall tokens/s (median of the log intervals after the first) and CPU tokens/s of `domino pretrain`.

    The CPU rate is the difference of two runs, ``iters`` and ``SHORT`` iterations, so start-up (imports,
    DeepSpeed set-up) cancels; CPU time hardly depends on how loaded the shared machine is, wall time does.
    """
    records, cpu_long = _pretrain(threads, iters, work)
    _, cpu_short = _pretrain(threads, SHORT, work)
    wall = statistics.median([r["tokens_per_s"] for r in records if "eval" not in r][1:])
    return {"wall": wall, "cpu": TOKENS * (iters - SHORT) / (cpu_long - cpu_short)}


def step_rates(steps: dict, timed_steps: int, warmup: int) -> dict:
    """Wall and CPU tokens/s (medians) of each in-process step function, alternating step by step."""
    for step in steps.values():
        model_step._time_steps(step, warmup)
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for _ in range(timed_steps):
        for name, step in steps.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    return {name: {"wall": TOKENS / statistics.median(wall[name]), "cpu": TOKENS / statistics.median(cpu[name])}
            for name in steps}


def steps_in_child(threads: int, timed_steps: int, heap: str) -> dict:
    """:func:`step_rates` of the bare model step and the plain GPT, in a fresh process like ``domino pretrain``'s.

    A fresh process per measurement on both sides: measured in this long-lived process, the bare step's rate
    moved 7-10% between two runs on the idle machine while pretrain's did not. ``heap``: ``domino`` sets the
    host allocator as `domino pretrain` does, ``glibc`` keeps glibc's defaults.
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, __file__, "--child-steps", str(timed_steps), "--threads", str(threads),
                           "--heap", heap], check=True, env=env, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=36, help="iterations of each long `domino pretrain` run")
    parser.add_argument("--steps", type=int, default=10, help="timed in-process steps per round and model")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child-steps", type=int, default=None, help=argparse.SUPPRESS)  # see steps_in_child
    parser.add_argument("--heap", choices=("domino", "glibc"), default="domino", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_steps is not None:
        if args.heap == "domino":
            from domino.train.host_allocator import keep_step_buffers_in_heap

            keep_step_buffers_in_heap()  # first, before the models allocate, as `domino pretrain` does
        torch.set_num_threads(args.threads[0])
        print(json.dumps(step_rates(model_step._fresh_single_process_steps(), args.child_steps, warmup=2)))
        return 0

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads:
            torch.set_num_threads(threads)
            rounds = []
            for _ in range(args.rounds):
                measured = steps_in_child(threads, args.steps, "domino")
                glibc = steps_in_child(threads, args.steps, "glibc")
                rounds.append({"pretrain": pretrain_rates(threads, args.iters, Path(tmp)),
                               "model_step": measured["domino"], "model_step_glibc": glibc["domino"],
                               "plain": measured["plain"]})
            results[threads] = {"rounds": rounds, "ratios": {
                clock: {f"{a}_over_{b}": statistics.median(r[a][clock] / r[b][clock] for r in rounds)
                        for a, b in (("pretrain", "model_step"), ("model_step", "model_step_glibc"),
                                     ("model_step", "plain"), ("pretrain", "plain"))}
                for clock in ("wall", "cpu")}}
    load = os.getloadavg()  # the figures above were measured under about this load
    if args.json:
        print(json.dumps({"threads": results, "loadavg_after": load, "torch": torch.__version__}))
        return 0
    print(f"GPT {model_step.LAYERS}L/{model_step.HIDDEN}h, seq {model_step.SEQ}, micro-batch {model_step.BATCH}, "
          f"vocab {model_step.VOCAB}, fp32, no dropout; {args.rounds} rounds; load average after: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for clock in ("wall", "cpu"):
        print(f"{clock} tokens/s (medians over rounds) and ratios (medians of per-round ratios)")
        print(f"{'threads':>7} {'pretrain':>9} {'step':>7} {'(glibc)':>8} {'plain':>7}   {'pretrain/step':>13} "
              f"{'step/(glibc)':>12} {'step/plain':>10} {'pretrain/plain':>14}")
        for threads, r in results.items():
            med = {k: statistics.median(x[k][clock] for x in r["rounds"]) for k in KINDS}
            q = r["ratios"][clock]
            print(f"{threads:>7} {med['pretrain']:>9.0f} {med['model_step']:>7.0f} {med['model_step_glibc']:>8.0f} "
                  f"{med['plain']:>7.0f}   {q['pretrain_over_model_step']:>13.3f} "
                  f"{q['model_step_over_model_step_glibc']:>12.3f} {q['model_step_over_plain']:>10.3f} "
                  f"{q['pretrain_over_plain']:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
