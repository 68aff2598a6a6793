"""The ``--async-save`` scenario of ``test_async_save.py``, run in one :mod:`forked_ranks` zygote.

1. The reference: a 2-rank (DP=2, ZeRO-1) run saving synchronously at every iteration.
2. A chain of asynchronous runs of the same command (``--save DIR --load DIR``, a save every iteration, so a
   save is almost always in flight): each run but the last gets SIGKILLs at a random moment (seeded: a
   random delay after its first commit, then its ranks in a random order, a random 0-100 ms apart),
   and the next run resumes from what the kill left. The last one trains to the end.
3. The same job continued by two iterations with a full disk on rank 1 (``RLIMIT_FSIZE``): its background
   write of the first of them fails there.

Per kill the state on disk is recorded (``latest``, the directories, whether each checkpoint directory passes a
full CRC check); per run its losses and log lines.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Dict, List

TRAIN_ITERS = 12  # each killed run advances a few iterations: the chain ends well before the last
ARGS = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--train-iters", str(TRAIN_ITERS), "--eval-iters", "0", "--eval-interval", "0",
        "--hidden-dropout", "0.1", "--zero-stage", "1", "--save-interval", "1"]
WORLD = 2


def _losses(path: Path) -> Dict[int, float]:
    """The training losses a metrics file holds so far (a line still being written is skipped)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return {r["iteration"]: r["lm_loss"] for r in records if "eval" not in r}


def _latest_iteration(save: Path) -> int:
    try:
        return int((save / "latest").read_text().strip()[5:])
    except (OSError, ValueError):  # none yet, or being replaced
        return 0


def _wait_for_commit(save: Path, after: int, job, timeout: float = 60.0) -> bool:
    """Waits until ``latest`` names a checkpoint newer than ``after`` (this run committed one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _latest_iteration(save) > after:
            return True
        if any(job.status.get(r) is not None for r in range(WORLD)):
            return False
        time.sleep(0.005)
    return False


def _disk_state(save: Path) -> dict:
    from domino.checkpoint import manifest

    def intact(ckpt: Path) -> bool:  # a manifest, and every file it lists present with its size and CRC-32
        files = manifest.read_manifest(ckpt) if ckpt.is_dir() else None
        return files is not None and manifest.find_damage(ckpt) is None and manifest.verify(ckpt, files) is None

    names = sorted(p.name for p in save.iterdir()) if save.is_dir() else []
    latest = (save / "latest").read_text().strip() if (save / "latest").is_file() else None
    return {"names": names, "latest": latest,
            "intact": {name: intact(save / name) for name in names if name.startswith("iter_")}}


def _resumed_from(log: str):
    match = re.search(r"resumed from \S*?(iter_\d{7})", log)
    return match.group(1) if match else None


def run(zygote, out, seeds: str) -> dict:
    out = Path(out)
    reference = out / "sync"
    status = zygote.run([*ARGS, "--save", str(reference), "--load", str(reference),
                         "--metrics-file", str(out / "sync.jsonl")], WORLD, out / "logs")
    result = {"reference": {"status": status, "losses": _losses(out / "sync.jsonl")}, "runs": []}
    save = out / "async"
    for index, seed in enumerate([int(s) for s in seeds.split(",")] + [None]):
        metrics = out / f"async-{index}.jsonl"
        job = zygote.start([*ARGS, "--async-save", "--save", str(save), "--load", str(save),
                            "--metrics-file", str(metrics)], WORLD, out / "logs")
        run_record: dict = {"seed": seed}
        if seed is not None:
            rng = random.Random(seed)
            reached = _wait_for_commit(save, _latest_iteration(save), job)
            time.sleep(rng.uniform(0.0, 0.15))
            first = rng.randrange(WORLD)
            job.kill(first)
            time.sleep(rng.uniform(0.0, 0.1))
            job.kill(1 - first)
            run_record.update(reached=reached, killed_first=first)
        run_record["status"] = job.wait(120)
        run_record["after"] = _disk_state(save)
        logs: List[str] = [job.log(r) for r in range(WORLD)]
        run_record["resumed_from"] = _resumed_from(logs[0])
        run_record["damaged"] = any("DAMAGED" in log for log in logs)
        run_record["losses"] = _losses(metrics)
        run_record["log_tail"] = logs[0][-2500:]
        # The order of iterations and commits in rank 0's log: ("step", N) and ("commit", N).
        run_record["events"] = [("step", int(m.group(2))) if m.group(1) else ("commit", int(m.group(3)))
                                for m in re.finditer(r"(iteration)\s+(\d+)/|saved checkpoint \S*iter_(\d{7})",
                                                     logs[0])]
        result["runs"].append(run_record)
    # Then a full disk on rank 1: half of its optimizer file fits (DCP names rank 1's shard-00002-...).
    last = save / f"iter_{TRAIN_ITERS:07d}"
    limit = next((last / "optimizer").glob("shard-00002-*")).stat().st_size // 2
    before = {str(p.relative_to(save)): p.read_bytes() for p in last.rglob("*") if p.is_file()}
    # Two iterations past the end: a longer decay, taken on purpose (domino.train.schedule_check).
    job = zygote.start([*ARGS, "--async-save", "--save", str(save), "--load", str(save),
                        "--train-iters", str(TRAIN_ITERS + 2), "--override-opt_param-scheduler"],
                       WORLD, out / "logs", env={"DOMINO_TEST_FSIZE_RANK1": str(limit)})
    status = job.wait(120)
    after = {str(p.relative_to(save)): p.read_bytes() for p in last.rglob("*") if p.is_file()}
    logs = [job.log(r) for r in range(WORLD)]
    result["disk_full"] = {"status": status, "after": _disk_state(save), "unchanged": before == after,
                           "errors": [[line for line in log.splitlines() if line.startswith("domino pretrain: error:")]
                                      for log in logs],
                           "tracebacks": ["Traceback" in log for log in logs]}
    return result
