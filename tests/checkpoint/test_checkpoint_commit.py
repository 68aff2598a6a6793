"""The checkpoint commit order, fault by fault: a save cut short at any step, then a restart of the same
command, resumes from an intact checkpoint and reproduces the uninterrupted run's losses exactly.

A save (``domino/checkpoint/checkpointing.py``) writes model shards, optimizer and RNG states and
``checkpoint.json`` into ``.tmp-iter_N``, renames it to ``iter_N``, then points ``latest`` at it, then
prunes old checkpoints. Each step in turn is made to crash (the injected exception propagates out of
``pretrain`` like a dying process: nothing in the save catches it) during the save of iteration 4. The
restart must resume from ``iter_0000002`` when the crash came before ``latest`` moved, from ``iter_0000004``
after: also when ``iter_0000004`` was renamed into place but ``latest`` never named it (``latest`` decides, with a
warning naming the newer one: ``domino/checkpoint/discovery.py``). The restart saves at 3 and 6, so no save of
its own replaces the ``.tmp-iter_0000004.<token>`` a crash before the rename left: its start, holding the save root,
must sweep it (``domino/checkpoint/leftovers.py``).
Everything runs in one real gloo process, ``pretrain()`` called in-process on a 256-token mock corpus.
"""

from __future__ import annotations

import logging
import os
import re
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


#: The fault points whose crash leaves ``.tmp-iter_0000004`` (all before the rename).
LEFT_A_TEMPORARY = ("model-shard", "optimizer-state", "rng-state", "meta", "rename")


class SimulatedCrash(BaseException):
    """Raised at the fault point; BaseException so no ``except Exception`` on the way can swallow it."""


def _crash_when(monkeypatch, owner, name: str, point: str, condition) -> None:
    """Replaces ``owner.name`` by a wrapper that raises :class:`SimulatedCrash` when ``condition(*args)``."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if condition(*args):
            raise SimulatedCrash(point)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def _install_fault(point: str, monkeypatch) -> None:
    """Makes step ``point`` of the save of :data:`CRASH_AT` crash (after a partial effect where a real crash
    could leave one)."""
    from domino.checkpoint import checkpointing, distributed_io, model_shards, on_disk

    def saving(path) -> bool:
        return f".tmp-{CRASH_AT}" in str(path)

    if point == "model-shard":
        _crash_when(monkeypatch, model_shards, "save_model_shard", point, lambda ckpt_dir, *_: saving(ckpt_dir))
    elif point == "optimizer-state":
        _crash_when(monkeypatch, distributed_io, "save", point, lambda directory, *_: saving(directory))
    elif point == "rng-state":
        _crash_when(monkeypatch, checkpointing, "_atomic_torch_save", point,
                    lambda obj, path: saving(path) and Path(path).parent.name == "rng")
    elif point == "meta":
        _crash_when(monkeypatch, on_disk, "write_checkpoint_meta", point, lambda ckpt_dir, meta: saving(ckpt_dir))
    elif point == "rename":
        _crash_when(monkeypatch, os, "replace", point, lambda src, dst: Path(dst).name == CRASH_AT)
    elif point == "latest":
        _crash_when(monkeypatch, on_disk, "write_latest", point, lambda root, tag: tag == CRASH_AT)
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


def _train(out: Path, name: str, extra=()) -> None:
    from domino.config import parse_config
    from domino.train.gpt_recipe import GPTRecipe
    from domino.runtime.state import current_mesh
    from domino.train.pretrain import pretrain

    save = out / name
    config = parse_config([*ARGS, "--save", str(save), "--load", str(save),
                           "--metrics-file", str(out / f"{name}.jsonl"), *extra])
    mesh = current_mesh()  # the one initialize_runtime built for every run of this process
    recipe = GPTRecipe(config, mesh)
    pretrain(config, recipe.model_builder, recipe.dataset_builder, recipe.forward_step, recipe.padded_vocab_size,
             recipe.tokenizer, mesh=mesh)


class _Log(logging.Handler):
    """The log lines of a run, as text."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _losses(path: Path) -> dict:
    import json

    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, path.read_text().splitlines())}


def _crash_then_resume(rank, world_size, out_dir, points):
    import pytest

    from domino.config import parse_config
    from domino.train.runtime_start import initialize_runtime

    initialize_runtime(parse_config(ARGS))  # once per process: every _train below is a run of this process
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
        log, domino_logger = _Log(), logging.getLogger("domino")
        level = domino_logger.level
        domino_logger.addHandler(log)
        domino_logger.setLevel(logging.INFO)
        try:
            # The restart: the same command, no fault, saving at 3 and 6, so only its start can sweep the
            # .tmp-iter_0000004.<token> a crash before the rename left.
            _train(out, point, ["--save-interval", "3"])
            error = None
        except Exception as exc:  # noqa: BLE001 - reported per fault point below
            error = f"{type(exc).__name__}: {exc}"
        finally:
            domino_logger.removeHandler(log)
            domino_logger.setLevel(level)
        resumed = _losses(out / f"{point}.jsonl")
        resumed_from = re.search(r"resumed from \S*?(iter_\d{7})", log.text)
        report[point] = {"crashed": crashed, "latest_after_crash": latest_after_crash, "error": error,
                         "losses_equal": resumed == reference,
                         "resumed_from": resumed_from.group(1) if resumed_from else None,
                         "warned_of_newer": f"newer sealed checkpoints exist: {CRASH_AT}" in log.text,
                         "swept": f"interrupted saves from {out / point}: .tmp-{CRASH_AT}" in log.text,
                         "final": sorted(p.name for p in (out / point).iterdir()
                                         if p.name not in (".save.lock", ".save.lock.json", "goodput.jsonl"))}
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
        elif r["resumed_from"] != expected:
            failures.append(f"{point}: the restart resumed from {r['resumed_from']}, expected {expected}")
        elif r["warned_of_newer"] != (point == "latest"):  # only then is the newer iter_0000004 sealed and named
            failures.append(f"{point}: warned of a newer sealed checkpoint: {r['warned_of_newer']}")
        elif r["swept"] != (point in LEFT_A_TEMPORARY):
            failures.append(f"{point}: swept .tmp-{CRASH_AT}.* at the start: {r['swept']}")
        elif not r["losses_equal"]:
            failures.append(f"{point}: the resumed run's losses differ from the uninterrupted run's")
        elif r["final"] != ["iter_0000006", "latest"]:
            failures.append(f"{point}: the save root ends as {r['final']}")
    assert not failures, "\n".join(failures)
