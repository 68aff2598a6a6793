"""`domino pretrain` runs for the pipeline tests: one tiny tied-embedding model, read back from its metrics file."""

from __future__ import annotations

from typing import List, Tuple

from train.train_helpers import TINY, read_metrics, run_pretrain

#: Tied embeddings (both copies of a two-stage run), mock data, fp32, no dropout, 4 layers (2 per stage), and a
#: --clip-grad small enough to clip every step (the norm over the stages then scales every update).
TIED_TINY = [*TINY, "--mock-data", "--vocab-size", "512", "--micro-batch-size", "2", "--lr-warmup-iters", "0",
             "--num-layers", "4", "--no-untie-embeddings-and-output-weights", "--clip-grad", "0.05"]


def run_logged(tmp_path, name: str, nproc: int, args: List[str]) -> Tuple[List[dict], str]:
    """The metrics records of `domino pretrain TIED_TINY ARGS` on ``nproc`` processes, and what it logged."""
    metrics = tmp_path / f"{name}.jsonl"
    proc = run_pretrain([*TIED_TINY, "--metrics-file", str(metrics), *args], nproc=nproc)
    return read_metrics(metrics), proc.stdout + proc.stderr


def run_records(tmp_path, name: str, nproc: int, args: List[str]) -> List[dict]:
    """The metrics records of `domino pretrain TIED_TINY ARGS` on ``nproc`` processes."""
    return run_logged(tmp_path, name, nproc, args)[0]
