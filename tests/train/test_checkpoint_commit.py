"""The checkpoint commit order, fault by fault: a save cut short at any step, then a restart of the same
command, resumes from an intact checkpoint and reproduces the uninterrupted run's losses exactly.

A save (``domino/train/checkpointing.py``) writes model shards, optimizer and RNG states and
``checkpoint.json`` into ``.tmp-iter_N``, renames it to ``iter_N``, then points ``latest`` at it, then
prunes old checkpoints. Each step in turn is made to crash (the injected exception propagates out of
``pretrain`` like a dying process: nothing in the save catches it) during the save of iteration 4. The
restart must resume from ``iter_0000002`` when the crash came before ``latest`` moved, from ``iter_0000004``
after. Everything runs in one real gloo process, ``pretrain()`` called in-process on a 256-token mock corpus.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from distributed_helpers import run_distributed

ARGS = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--train-iters", "6", "--save-interval", "2", "--keep-last", "1", "--eval-iters", "0",
        "--eval-interval", "0", "--hidden-dropout", "0.1"]  # dropout: the resume must restore RNG streams too
CRASH_AT = "iter_0000004"

#: fault point -> the checkpoint a restart must resume from
EXPECTED_RESUME = {
    "model-shard": "iter_0000002", "optimizer-state": "iter_0000002", "rng-state": "iter_0000002",
    "meta": "iter_0000002", "rename": "iter_0000002", "latest": "iter_0000002", "prune": "iter_0000004",
}


class SimulatedCrash(BaseException):
    """Raised at the fault point; BaseException so no ``except Exception`` on the way can swallow it."""


def _install_fault(point: str, monkeypatch) -> None:
    """Makes step ``point`` of the save of :data:`CRASH_AT` crash (after a partial effect where a real crash
    could leave one)."""
    from domino.model import weights_io
    from domino.train import checkpointing

    def saving_crash_iteration(path) -> bool:
        return f".tmp-{CRASH_AT}" in str(path)

    if point == "model-shard":
        real = weights_io.save_model_shard

        def save_model_shard(ckpt_dir, state_dict, tp_rank):
            if saving_crash_iteration(ckpt_dir):
                raise SimulatedCrash(point)
            return real(ckpt_dir, state_dict, tp_rank)

        monkeypatch.setattr(weights_io, "save_model_shard", save_model_shard)
    elif point in ("optimizer-state", "rng-state"):
        real_save = checkpointing._atomic_torch_save
        sub = {"optimizer-state": "optim", "rng-state": "rng"}[point]

        def atomic_torch_save(obj, path):
            if saving_crash_iteration(path) and Path(path).parent.name == sub:
                raise SimulatedCrash(point)
            return real_save(obj, path)

        monkeypatch.setattr(checkpointing, "_atomic_torch_save", atomic_torch_save)
    elif point == "meta":
        real_meta = weights_io.write_checkpoint_meta

        def write_checkpoint_meta(ckpt_dir, meta):
            if saving_crash_iteration(ckpt_dir):
                raise SimulatedCrash(point)
            return real_meta(ckpt_dir, meta)

        monkeypatch.setattr(weights_io, "write_checkpoint_meta", write_checkpoint_meta)
    elif point == "rename":
        real_replace = os.replace

        def replace(src, dst):
            if Path(dst).name == CRASH_AT:
                raise SimulatedCrash(point)
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    elif point == "latest":
        real_latest = weights_io.write_latest

        def write_latest(root, tag):
            if tag == CRASH_AT:
                raise SimulatedCrash(point)
            return real_latest(root, tag)

        monkeypatch.setattr(weights_io, "write_latest", write_latest)
    elif point == "prune":
        real_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            path = Path(path)
            if path.name.startswith("iter_") and path.name != CRASH_AT:
                # Half-deleted: the crash lands after the metadata and the model shards are gone.
                (path / "checkpoint.json").unlink()
                real_rmtree(path / "model")
                raise SimulatedCrash(point)
            return real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(shutil, "rmtree", rmtree)
    else:
        raise ValueError(point)


def _train(out: Path, name: str) -> None:
    from domino.config import parse_config
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.pretrain import pretrain

    save = out / name
    config = parse_config([*ARGS, "--save", str(save), "--load", str(save),
                           "--metrics-file", str(out / f"{name}.jsonl")])
    recipe = GPTRecipe(config)
    pretrain(config, recipe.model_builder, recipe.dataset_builder, recipe.forward_step, recipe.padded_vocab_size,
             recipe.tokenizer)


def _losses(path: Path) -> dict:
    import json

    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, path.read_text().splitlines())}


def _crash_then_resume(rank, world_size, out_dir, points):
    import pytest

    out = Path(out_dir)
    _train(out, "reference")
    reference = _losses(out / "reference.jsonl")
    report = {}
    for point in points:
        with pytest.MonkeyPatch.context() as monkeypatch:
            _install_fault(point, monkeypatch)
            try:
                _train(out, point)
                crashed = False
            except SimulatedCrash:
                crashed = True
        latest_after_crash = (out / point / "latest").read_text().strip()
        try:
            _train(out, point)  # the restart: the same command, no fault
            error = None
        except Exception as exc:  # noqa: BLE001 - reported per fault point below
            error = f"{type(exc).__name__}: {exc}"
        resumed = _losses(out / f"{point}.jsonl")
        report[point] = {"crashed": crashed, "latest_after_crash": latest_after_crash, "error": error,
                         "losses_equal": resumed == reference,
                         "final": sorted(p.name for p in (out / point).iterdir() if not p.name.startswith("."))}
    return report


def test_a_save_cut_short_at_any_step_resumes_from_an_intact_checkpoint(tmp_path):
    (report,) = run_distributed(_crash_then_resume, 1, str(tmp_path), list(EXPECTED_RESUME))
    failures = []
    for point, expected in EXPECTED_RESUME.items():
        r = report[point]
        if not r["crashed"]:
            failures.append(f"{point}: the fault never fired")
        elif r["error"]:
            failures.append(f"{point}: the restart failed: {r['error']}")
        elif r["latest_after_crash"] != expected:
            failures.append(f"{point}: after the crash latest = {r['latest_after_crash']}, expected {expected}")
        elif not r["losses_equal"]:
            failures.append(f"{point}: the resumed run's losses differ from the uninterrupted run's")
        elif r["final"] != ["iter_0000006", "latest"]:
            failures.append(f"{point}: the save root ends as {r['final']}")
    assert not failures, "\n".join(failures)
