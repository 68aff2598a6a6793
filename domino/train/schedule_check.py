"""The learning-rate schedule and batch ramp a run trains with: recorded in every checkpoint, checked on resume.

A resume with another ``--lr``, ``--min-lr``, warm-up, decay style or length, or batch ramp would silently change
what the rest of the run does (the schedule is a pure function of the consumed samples:
:mod:`domino.train.schedules`). Megatron refuses by default: Megatron-LM d98e8a64
``megatron/core/optimizer_param_scheduler.py`` ``OptimizerParamScheduler._check_and_set`` asserts that each of
max/min learning rate, warm-up steps, decay steps and decay style equals the checkpoint's, unless
``--override-opt_param-scheduler`` (take the run's values) or ``--use-checkpoint-opt_param-scheduler`` (take the
checkpoint's) is given; both flags are declared in ``megatron/training/config/training_config.py`` at that commit
(at core_r0.11.0, 7c00175e: ``megatron/training/arguments.py``). domino does the same, in one line naming both
values, for the resolved schedule (lengths in samples, as Megatron counts them) and for the batch ramp, compared
as the batches it gives (``--rampup-batch-size`` and the ``--step-batch-size-schedule`` of the same batches are the
same ramp). ``--train-iters`` / ``--train-samples`` are recorded and checked through the decay length they set,
as Megatron's "total number of iterations" check compares ``lr_decay_steps``: a run extended past an explicit
``--lr-decay-iters`` continues. Checkpoints saved before the record keep loading, unchecked.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

from domino.checkpoint.on_disk import META_FILE, Checkpoint
from domino.config import ConfigError, DominoConfig
from domino.config.batch_schedule import batch_schedule
from domino.train.schedules import LearningRateSchedule

logger = logging.getLogger(__name__)

#: The key of the record in ``checkpoint.json``.
RECORD_KEY = "schedule"
#: The learning-rate schedule's fields as the record stores them, each with what sets it.
LR_FIELDS = {"max_lr": "--lr", "min_lr": "--min-lr", "warmup_steps": "warm-up samples (--lr-warmup-*)",
             "decay_steps": "decay samples (--lr-decay-*, else --train-iters / --train-samples)",
             "style": "--lr-decay-style", "init_lr": "--lr-warmup-init",
             "wsd_decay_steps": "WSD decay samples (--lr-wsd-decay-*)", "wsd_style": "--lr-wsd-decay-style"}
#: The batch ramp's fields (``TrainConfig``'s), each with its flag.
RAMP_FIELDS = {"rampup_batch_size": "--rampup-batch-size", "step_batch_size_schedule": "--step-batch-size-schedule"}
RAMP_LABEL = ("batch ramp ([consumed samples, global batch] at each change; --rampup-batch-size, "
              "--step-batch-size-schedule)")
#: Iterations walked to resolve a ramp (each a few operations on the host, once per start).
MAX_RAMP_ITERATIONS = 1_000_000
OVERRIDE, USE_CHECKPOINT = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"


def run_schedule(config: DominoConfig, data_parallel_size: int) -> Tuple[LearningRateSchedule, int]:
    """This run's learning-rate schedule and iteration count, from its flags."""
    t, batches = config.train, batch_schedule(config, data_parallel_size)
    train_iters = t.train_iters if t.train_iters is not None else batches.train_iters(t.train_samples)
    return LearningRateSchedule.from_config(t, train_iters, batches.global_batch_size), train_iters


def ramp_steps(config: DominoConfig, data_parallel_size: int) -> List[List[int]]:
    """``[consumed samples, global batch]`` wherever the batch changes, until it reaches its final size."""
    batches, steps, consumed = batch_schedule(config, data_parallel_size), [], 0
    for _ in range(MAX_RAMP_ITERATIONS):
        batch = batches.global_batch_size_at(consumed)
        if not steps or steps[-1][1] != batch:
            steps.append([consumed, batch])
        if batch == batches.global_batch_size:
            break
        consumed += batch
    return steps


def record(schedule: LearningRateSchedule, config: DominoConfig, train_iters: int,
           data_parallel_size: int) -> Dict[str, Any]:
    """What a checkpoint stores under :data:`RECORD_KEY` (plain JSON values)."""
    return {"lr": {name: getattr(schedule, name) for name in LR_FIELDS}, "train_iters": train_iters,
            "train_samples": config.train.train_samples, "ramp": ramp_steps(config, data_parallel_size),
            "ramp_flags": {name: _plain(getattr(config.train, name)) for name in RAMP_FIELDS}}


def _stored(ckpt: Checkpoint) -> Optional[Dict[str, Any]]:
    """The checkpoint's record, its shape checked (``checkpoint.json`` is untrusted); None before the record."""
    stored = ckpt.meta.get(RECORD_KEY)
    if stored is None:
        return None
    lr, ramp, flags = (stored.get("lr"), stored.get("ramp"), stored.get("ramp_flags")) if isinstance(
        stored, dict) else (None, None, None)
    if not (isinstance(lr, dict) and set(lr) == set(LR_FIELDS) and isinstance(ramp, list) and all(
            isinstance(step, list) and len(step) == 2 and all(isinstance(n, int) for n in step) for step in ramp)
            and isinstance(flags, dict) and set(flags) == set(RAMP_FIELDS)):
        raise ConfigError(f"{ckpt.path / META_FILE}: field {RECORD_KEY} must hold lr ({', '.join(LR_FIELDS)}), "
                          f"ramp ([samples, batch] pairs) and ramp_flags ({', '.join(RAMP_FIELDS)}), got "
                          f"{str(stored)[:160]}")
    for name, value in lr.items():
        kind = str if name in ("style", "wsd_style") else (int, float)
        if not (isinstance(value, kind) and not isinstance(value, bool)) and not (
                name == "wsd_decay_steps" and value is None):
            raise ConfigError(f"{ckpt.path / META_FILE}: field {RECORD_KEY}.lr.{name} has the wrong type: {value!r}")
    return stored


def _shapes_the_rate(name: str, style: str) -> bool:
    """Whether field ``name`` changes any rate of a ``style`` schedule (:meth:`LearningRateSchedule.lr_at_samples`:
    a constant rate has no decay, only WSD anneals). Megatron compares every field; a field no rate depends on
    (the decay length of a constant schedule extended by --train-iters) is let through here."""
    if style == "constant":
        return name not in ("min_lr", "decay_steps", "wsd_decay_steps", "wsd_style")
    return style == "WSD" or name not in ("wsd_decay_steps", "wsd_style")


def _differences(stored: Dict[str, Any], schedule: LearningRateSchedule, config: DominoConfig,
                 data_parallel_size: int) -> list:
    styles = (stored["lr"]["style"], schedule.style)
    diffs = [f"{label}: checkpoint {stored['lr'][name]} vs run {getattr(schedule, name)}"
             for name, label in LR_FIELDS.items() if stored["lr"][name] != getattr(schedule, name)
             and any(_shapes_the_rate(name, style) for style in styles)]
    ramp = ramp_steps(config, data_parallel_size)
    if stored["ramp"] != ramp:
        diffs.append(f"{RAMP_LABEL}: checkpoint {stored['ramp']} vs run {ramp}")
    return diffs


def _plain(value: Any) -> Any:
    """A config value as JSON gives it back (a tuple becomes a list)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def resumed_schedule(ckpt: Optional[Checkpoint], config: DominoConfig, data_parallel_size: int,
                     weights_only: bool) -> Tuple[LearningRateSchedule, DominoConfig]:
    """The learning-rate schedule this run continues ``ckpt`` with, and ``config`` with the batch ramp it continues;
    refuses a changed one in one line.

    With ``--use-checkpoint-opt_param-scheduler`` the checkpoint's schedule and batch ramp are taken (the ramp
    into the config returned, whose batch schedule the loop builds afterwards); with
    ``--override-opt_param-scheduler`` this run's, said in one line. A warm start (``--finetune``) begins a schedule
    of its own.

    Raises:
        ConfigError: naming each changed value with the checkpoint's and this run's, and the two flags.
    """
    schedule, _ = run_schedule(config, data_parallel_size)
    stored = _stored(ckpt) if ckpt is not None and not weights_only else None
    if stored is None:
        if ckpt is not None and not weights_only:
            logger.info("%s records no learning-rate schedule (saved before the record): not checked", ckpt)
        return schedule, config
    diffs = _differences(stored, schedule, config, data_parallel_size)
    c = config.checkpoint
    if not diffs:
        return schedule, config
    if c.override_opt_param_scheduler:
        logger.info("%s: this run's schedule replaces the checkpoint's (%s)", OVERRIDE, "; ".join(diffs))
        return schedule, config
    if c.use_checkpoint_opt_param_scheduler:
        logger.info("%s: the checkpoint's schedule replaces this run's (%s)", USE_CHECKPOINT, "; ".join(diffs))
        ramp = {name: stored["ramp_flags"][name] for name in RAMP_FIELDS}
        return dataclasses.replace(schedule, **stored["lr"]), config.replace(**ramp)
    raise ConfigError(f"--load {ckpt}: the learning-rate schedule or batch ramp differs from the checkpoint's "
                      f"({'; '.join(diffs)}); resume with the checkpoint's values, or give {USE_CHECKPOINT} to take "
                      f"them or {OVERRIDE} to take this run's")
