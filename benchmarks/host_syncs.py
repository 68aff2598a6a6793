"""Host reads of tensor values (device syncs on a GPU) and device tensors made from Python numbers (host-to-device
copies the host waits for on a GPU) per training iteration, per rank, before and after.

Runs a short `domino pretrain` under the counting probe of ``domino/train/host_syncs.py`` for a few layouts,
on this checkout and on a baseline commit (default ``ec44f0d``, extracted with ``git archive``), and prints
reads per iteration per rank inside iterations (``step``: between log intervals) by owner (domino, deepspeed),
the device tensors made from Python numbers per iteration (``copies/iter``, all owners), and reads per log
interval. Iterations run with ``--log-interval 5`` so most iterations are not logged.

    python benchmarks/host_syncs.py [--baseline ec44f0d] [--iters 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "domino" / "train" / "host_syncs.py"
#: The runner script written beside the probe's copy (its folder is first on sys.path when run as a script).
RUNNER = """import sys

from probe import run_probed
from domino.cli.main import main

sys.exit(run_probed(sys.argv[1], main, sys.argv[2:]))
"""
TINY = ["--preset", "tiny", "--mock-data", "--vocab-size", "512", "--num-workers", "0", "--seed", "7",
        "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "5"]
LAYOUTS = {
    "1 process, ZeRO-1": (1, ["--zero-stage", "1"]),
    "1 process, ZeRO-0 (domino clips)": (1, ["--zero-stage", "0"]),
    "TP=2 Domino, ZeRO-1": (2, ["--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--zero-stage", "1"]),
    "TP=2 Domino, bf16 ZeRO-1": (2, ["--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--bf16",
                                     "--zero-stage", "1"]),
    "DP=2, ZeRO-1": (2, []),
    "DP=2, ZeRO-1, --clip-grad 0": (2, ["--clip-grad", "0"]),
    "DP=2, bf16 ZeRO-2": (2, ["--bf16", "--zero-stage", "2"]),
    "DP=2, fp16 ZeRO-1": (2, ["--fp16", "--zero-stage", "1"]),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(source: Path, nproc: int, args, iters: int, out_dir: str) -> list:
    """Runs the probe over ``source``'s domino; returns the per-rank event lists."""
    prefix = os.path.join(out_dir, "syncs")
    # A copy of the probe outside the package, so that it measures ``source``'s domino (an older one too),
    # and a runner beside it that calls that domino's CLI under it.
    shutil.copy(PROBE, os.path.join(out_dir, "probe.py"))
    runner = os.path.join(out_dir, "run_probed.py")
    with open(runner, "w", encoding="utf-8") as handle:
        handle.write(RUNNER)
    command = [sys.executable, runner, prefix, "pretrain", *TINY, "--train-iters", str(iters), *args]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                   str(_free_port()), *command[1:]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(source), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=out_dir)
    if proc.returncode != 0:
        raise SystemExit(f"probe run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in range(nproc)]


def _summary(events_by_rank: list, iters: int) -> dict:
    """Mean over ranks of reads per iteration (step phase, by owner) and per log interval."""
    logs = -(-iters // 5)
    ranks = len(events_by_rank)

    def total(phase, owner=None, copies=False):
        return sum(e["count"] for events in events_by_rank for e in events
                   if e["phase"] == phase and (owner is None or e["owner"] == owner)
                   and e["method"].endswith("->device") == copies) / ranks

    sites = sorted({f"{e['owner']}: {e['where']} ({e['method']})" for events in events_by_rank for e in events
                    if e["phase"] == "step"})
    return {"domino_per_iter": total("step", "domino") / iters, "deepspeed_per_iter": total("step", "deepspeed") / iters,
            "other_per_iter": total("step", "other") / iters, "copies_per_iter": total("step", copies=True) / iters,
            "per_log_interval": total("log") / logs,
            "step_sites": sites}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="ec44f0d", help="git commit to compare with ('' to skip)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"now": REPO}
        if args.baseline:
            base = Path(tmp) / "baseline"
            base.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "domino"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
            sources = {args.baseline: base, "now": REPO}
        for name, (nproc, extra) in LAYOUTS.items():
            for label, source in sources.items():
                run_dir = tempfile.mkdtemp(dir=tmp)
                results[(name, label)] = _summary(_probe(source, nproc, extra, args.iters, run_dir), args.iters)
    if args.json:
        print(json.dumps({f"{k[0]} | {k[1]}": v for k, v in results.items()}, indent=2))
        return
    print(f"host reads of tensor values and device tensors from Python numbers per rank ({args.iters} iterations, "
          "--log-interval 5)")
    print(f"{'layout':36s} {'code':9s} {'domino/iter':>11s} {'deepspeed/iter':>14s} {'other/iter':>10s} "
          f"{'copies/iter':>11s} {'per log':>8s}")
    for (name, label), r in results.items():
        print(f"{name:36s} {label:9s} {r['domino_per_iter']:11.2f} {r['deepspeed_per_iter']:14.2f} "
              f"{r['other_per_iter']:10.2f} {r.get('copies_per_iter', 0.0):11.2f} {r['per_log_interval']:8.1f}")
    print("\nsites read inside iterations (now):")
    for (name, label), r in results.items():
        if label == "now":
            print(f"  {name}: " + ("; ".join(r["step_sites"]) or "none"))


if __name__ == "__main__":
    main()
