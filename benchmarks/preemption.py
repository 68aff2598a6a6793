"""What a preemption costs on the local launch backend: goodput over repeated preemptions, and SIGTERM to durable.

One job (``--nproc`` processes on one node, real torchrun, ``--exit-signal-handler``, a save every
``--save-interval`` steps, ``--async-save`` unless ``--sync-save``) is preempted as Kueue does it
(:meth:`~domino.launch.local_backend.LocalLauncher.preempt`: SIGTERM to the pod, the grace period, SIGKILL of what
is left) every ``--preempt-every`` steps it trains, and submitted again with the same run id (its own save root:
the resubmission resumes it), until it has trained ``--iters`` steps. Rank 0's log lines give every step that ran
(a step trained twice, after a resume from an older checkpoint, is counted twice) and its time, and the
``SIGTERM: checkpoint ... durable X s after the signal`` lines give the time from each SIGTERM to a committed
checkpoint.

Reported: step goodput = useful steps / steps run; time goodput = the useful steps' own time (their logged
iteration times) / the wall time of all submissions together (start-up, saves, the SIGTERM and restarts
included); and the SIGTERM-to-durable times.

It also prints the timeline of each preemption, in seconds after the SIGTERM: the checkpoint durable, the pods
gone, the job submitted again, and from the goodput ledger the new rank 0's process start, torch.distributed
ready, the model built, the checkpoint loaded and the first step; and the run's own ``domino goodput`` account.

    flock /work/bench.lock python benchmarks/preemption.py [--iters 400] [--preempt-every 100] [--save-interval 50]
        [--model tiny|165mb|demo] [--nproc 1] [--tp 1] [--sync-save] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from domino.goodput.accounting import account  # noqa: E402
from domino.goodput.ledger import LEDGER_FILE, read_events  # noqa: E402
from domino.launch import JobSpec  # noqa: E402
from domino.launch.local_backend import LocalLauncher  # noqa: E402

MODELS = {
    "tiny": ["--preset", "tiny", "--vocab-size", "256"],
    # benchmarks/async_save.py's model: 10.3 M parameters, 165 MB of checkpoint state.
    "165mb": ["--num-layers", "4", "--hidden-size", "384", "--num-attention-heads", "6", "--vocab-size", "8192",
              "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2"],
    # The pipeline demo's model (1.07 M parameters; its 2,048-token BPE vocabulary).
    "demo": ["--preset", "demo", "--vocab-size", "2048"],
}
ITERATION = re.compile(r"iteration\s+(\d+)/\d+ .*\| iter time ([\d.]+) ms")
DURABLE = re.compile(r"durable ([\d.]+) s after the signal")


def run(args: argparse.Namespace) -> Dict:
    workdir = tempfile.mkdtemp(prefix="domino-preemption-")
    pretrain = [*MODELS[args.model], "--tensor-model-parallel-size", str(args.tp), "--mock-data", "--num-workers", "0",
                "--seed", "7", "--train-iters",
                str(args.iters), "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "0",
                "--save-interval", str(args.save_interval), *([] if args.sync_save else ["--async-save"])]
    spec = JobSpec(name="goodput", image="i", nodes=1, nproc_per_node=args.nproc * args.tp,
                   termination_grace_period_s=60,
                   pretrain_args=pretrain, env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    steps: List[int] = []
    step_s: Dict[int, float] = {}  # the last run of each step
    durable: List[float] = []
    submissions, started = 0, time.perf_counter()
    startup_s: List[float] = []  # each submission: its start to its first step's log line
    stop_s: List[float] = []  # each preemption: the preempt call to the submission's end (pods gone)
    wall_marks: List[Dict[str, float]] = []  # each submission's submit, preempt and end as UNIX times (the ledger's)
    while True:
        submissions += 1
        launcher, ran, submitted, preempted = None, [], time.perf_counter(), []
        marks = {"submitted": time.time()}
        wall_marks.append(marks)

        def log(line: str) -> None:
            match = ITERATION.search(line)
            if match:
                if not ran:
                    startup_s.append(time.perf_counter() - submitted)
                ran.append(int(match.group(1)))
                step_s[int(match.group(1))] = float(match.group(2)) / 1000
            match = DURABLE.search(line)
            if match:
                durable.append(float(match.group(1)))

        launcher = LocalLauncher(log=log)
        done = threading.Event()

        def preempt_later():
            while not done.is_set() and len(ran) < args.preempt_every:
                time.sleep(0.02)
            if not done.is_set():
                preempted.append(time.perf_counter())
                marks["preempted"] = time.time()
                launcher.preempt()

        watcher = threading.Thread(target=preempt_later, daemon=True)
        watcher.start()
        result = launcher.run(spec, run_id="g", workdir=workdir, timeout_s=3600)
        marks["ended"] = time.time()
        done.set()
        if preempted:
            stop_s.append(time.perf_counter() - preempted[0])
        steps += ran
        if result.succeeded:
            break
        if result.phase != "Suspended" or submissions > 50:
            raise SystemExit(f"submission {submissions} ended {result.phase}: {result.reason}\n"
                             + "\n".join(result.log_tail[-20:]))
    wall = time.perf_counter() - started
    useful = sorted(set(steps))
    return {"model": args.model, "nproc": args.nproc, "iters": args.iters, "preempt_every": args.preempt_every,
            "save_interval": args.save_interval, "async_save": not args.sync_save, "submissions": submissions,
            "preemptions": submissions - 1, "steps_run": len(steps), "useful_steps": len(useful),
            "step_goodput": len(useful) / len(steps), "wall_s": round(wall, 1),
            "useful_step_s": round(sum(step_s.values()), 1),
            "time_goodput": sum(step_s.values()) / wall,
            "median_step_ms": round(1000 * statistics.median(step_s.values()), 1),
            "sigterm_to_durable_s": durable, "startup_s": [round(t, 1) for t in startup_s],
            "stop_s": [round(t, 1) for t in stop_s], "load": os.getloadavg(),
            "timeline": timeline(workdir, wall_marks, durable), "ledger": ledger_account(workdir)}


def _ledger_root(workdir: str):
    found = sorted(Path(workdir).rglob(LEDGER_FILE))
    return found[0].parent if found else None


def ledger_account(workdir: str) -> Dict:
    """The run's own goodput account (``domino goodput``), from the ledger in its save root."""
    root = _ledger_root(workdir)
    if root is None:
        return {}
    report = account(read_events(str(root))).to_dict()
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in report.items() if k != "per_attempt"}


def timeline(workdir: str, marks: List[Dict[str, float]], durable: List[float]) -> List[Dict[str, float]]:
    """For each preemption: seconds after the SIGTERM at which each step of the stop and the next start happened
    (the benchmark's own marks, the SIGTERM-to-durable log line, and the next attempt's ledger records)."""
    root = _ledger_root(workdir)
    events = read_events(str(root)) if root is not None else []
    attempts: Dict[str, List[dict]] = {}
    for event in events:
        attempts.setdefault(event["attempt"], []).append(event)
    starts = [(next(e for e in evs if e["event"] == "start"), evs) for evs in attempts.values()
              if any(e["event"] == "start" for e in evs)]
    out = []
    for index, mark in enumerate(marks[:-1]):
        if "preempted" not in mark:
            continue
        t0, nxt = mark["preempted"], marks[index + 1]
        row = {"durable": durable[index] if index < len(durable) else None, "pods_gone": mark["ended"] - t0,
               "resubmitted": nxt["submitted"] - t0}
        later = [(start, evs) for start, evs in starts if start["process_start"] > nxt["submitted"] - 1]
        if later:
            start, evs = min(later, key=lambda pair: pair[0]["process_start"])
            first = next((e for e in evs if e["event"] == "first_step"), None)
            row.update(rank0_process_start=start["process_start"] - t0, runtime_ready=start["runtime_ready"] - t0,
                       model_built=start["model_built"] - t0, checkpoint_loaded=start["t"] - t0,
                       checkpoint_load_s=start["load_s"], first_step=first["t"] - t0 if first else None)
        out.append({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--preempt-every", type=int, default=100)
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--nproc", type=int, default=1, help="data-parallel processes (times --tp)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--sync-save", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['model']} x {out['nproc']} process(es), {out['iters']} steps, preempted every "
          f"{out['preempt_every']} ({out['preemptions']} times), save every {out['save_interval']}, "
          f"{'async' if out['async_save'] else 'sync'} save")
    print(f"step goodput {100 * out['step_goodput']:.1f}% ({out['useful_steps']} useful of {out['steps_run']} run); "
          f"time goodput {100 * out['time_goodput']:.1f}% ({out['useful_step_s']} s of steps in {out['wall_s']} s "
          f"wall; median step {out['median_step_ms']} ms)")
    print("SIGTERM to durable checkpoint: " + ", ".join(f"{s:.2f} s" for s in out["sigterm_to_durable_s"]))
    print(f"start-up to the first step per submission: {out['startup_s']} s; preempt to pods gone: {out['stop_s']} s")
    if out["preemptions"]:
        per = (sum(out["startup_s"][1:]) + sum(out["stop_s"])) / out["preemptions"]
        print(f"each preemption costs {per:.1f} s of wall time and {out['steps_run'] - out['useful_steps']} "
              f"steps in all; 97% time goodput needs >= {per * 0.97 / 0.03:.0f} s of steps between preemptions; "
              f"a preemption every 10 min of steps: {100 * 600 / (600 + per):.1f}%, every 2 min: "
              f"{100 * 120 / (120 + per):.1f}%")
        for row in out["timeline"]:
            print("timeline after SIGTERM (s): " + ", ".join(f"{k} {v}" for k, v in row.items() if v is not None))
    if out["ledger"]:
        print(f"the run's own ledger (domino goodput): goodput {100 * out['ledger']['goodput']:.1f}% of "
              f"{out['ledger']['wall_s']} s; start-up {out['ledger']['startup_s']} s, idle {out['ledger']['idle_s']} s, "
              f"checkpoint {out['ledger']['checkpoint_s']} s, lost {out['ledger']['lost_s']} s")
    print(f"load average {out['load'][0]:.2f} {out['load'][1]:.2f} {out['load'][2]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
