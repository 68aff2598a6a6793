"""End-to-end `domino pretrain` throughput: tokens/s, TFLOP/s, MFU and the share of time spent waiting for data.

Reference config: 4 layers / 256 hidden / 4 heads / seq 256 / micro-batch 8, fp32, an 8k BPE trained on the
built-in Shakespeare corpus. Layouts: 1 process; 2 processes TP=2 synchronous and with Domino (2 chunks);
2 processes DP=2 with ZeRO-1. "TP comm wait" is the share of step time a process sat blocked in
tensor-parallel all-reduces (the `comm-wait` timer). MFU is against this machine's measured fp32 matmul peak (one 2048^3 matmul per process count),
measured in the same run, since CPUs have no data-sheet peak we could trust.

    python benchmarks/train.py [--iters 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--max-position-embeddings", "256", "--micro-batch-size", "8", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--lr", "3e-4", "--lr-warmup-iters", "2", "--eval-interval", "0",
         "--eval-iters", "0", "--timing-log-level", "1", "--num-workers", "1"]
LAYOUTS = {
    "1 process": (1, []),
    "TP=2 sync": (2, ["--tensor-model-parallel-size", "2"]),
    "TP=2 Domino": (2, ["--tensor-model-parallel-size", "2", "--domino-chunks", "2"]),
    "DP=2 ZeRO-1": (2, ["--zero-stage", "1"]),
}


def measured_peak_tflops(threads: int) -> float:
    """fp32 matmul TFLOP/s of one process with ``threads`` threads (best of 5)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e12


def prepare_data(work: Path) -> tuple:
    domino = [sys.executable, "-m", "domino"]
    tok = work / "tok"
    subprocess.run([*domino, "train-tokenizer", "--builtin-corpus", "shakespeare", "--vocab-size", "8192",
                    "--output", str(tok)], check=True, capture_output=True)
    subprocess.run([*domino, "preprocess", "--builtin-corpus", "shakespeare", "--tokenizer", str(tok),
                    "--output-prefix", str(work / "shk"), "--append-eod"], check=True, capture_output=True)
    return str(tok), str(work / "shk_text_document")


def run_layout(nproc: int, extra: list, data: tuple, iters: int, peak: float, work: Path) -> dict:
    metrics = work / f"metrics-{nproc}-{'-'.join(extra) or 'single'}.jsonl"
    args = [*MODEL, "--tokenizer", data[0], "--data-path", data[1], "--train-iters", str(iters),
            "--log-interval", "5", "--metrics-file", str(metrics), "--peak-tflops", str(peak), *extra]
    if nproc == 1:
        cmd = [sys.executable, "-m", "domino", "pretrain", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "domino",
               "pretrain", *args]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(2 // nproc))
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    records = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    steady = [r for r in records if "eval" not in r][1:]  # the first interval includes warm-up
    iter_ms = sum(r["iteration_time_s"] for r in steady) / len(steady) * 1000
    data_ms = sum(r.get("timers_ms_per_iter", {}).get("batch-generator", 0.0) for r in steady) / len(steady)
    comm_ms = sum(r.get("timers_ms_per_iter", {}).get("comm-wait", 0.0) for r in steady) / len(steady)
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
            "tflops_per_device": sum(r["tflops_per_device"] for r in steady) / len(steady),
            "mfu": sum(r["mfu"] for r in steady) / len(steady), "iteration_ms": iter_ms,
            "data_wait_share": data_ms / iter_ms, "comm_wait_share": comm_ms / iter_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = prepare_data(work)
        results = {}
        for name, (nproc, extra) in LAYOUTS.items():
            peak = measured_peak_tflops(2 // nproc)
            results[name] = run_layout(nproc, extra, data, args.iters, peak, work)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'layout':<14} {'tokens/s':>10} {'TFLOP/s/dev':>12} {'MFU':>7} {'iter ms':>9} {'data wait':>10} "
          f"{'TP comm wait':>13}")
    for name, r in results.items():
        print(f"{name:<14} {r['tokens_per_s']:>10,.0f} {r['tflops_per_device']:>12.4f} {100 * r['mfu']:>6.1f}% "
              f"{r['iteration_ms']:>9.1f} {100 * r['data_wait_share']:>9.2f}% {100 * r['comm_wait_share']:>12.2f}%")


if __name__ == "__main__":
    main()
