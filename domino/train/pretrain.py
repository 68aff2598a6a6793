"""``pretrain(config, model_builder, dataset_builder, forward_step)``: the training loop.

Distributed initialisation, the DeepSpeed engine (ZeRO data parallelism around tensor parallelism with
Domino), the learning-rate schedule, checkpoint save/resume, periodic evaluation and logging. The three
callables follow Megatron-LM's contracts, so a user can swap in their own model or data:

- ``model_builder(config) -> torch.nn.Module``
- ``dataset_builder((train, valid, test) sample counts) -> (train, valid, test)`` datasets
- ``forward_step(data_iterator, model) -> (output_tensor, loss_fn)`` where
  ``loss_fn(output_tensor) -> (loss, {"lm loss": data-parallel average})``
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from domino.config import ConfigError, DominoConfig, validate
from domino.data.loader import build_pretraining_data_loader
from domino.parallel import random as tp_random
from domino.parallel import state
from domino.train import checkpointing, engine as engine_setup
from domino.train.evaluation import evaluate, perplexity
from domino.train.metrics import MetricsWriter, format_iteration_line
from domino.train.schedules import LearningRateSchedule
from domino.train.throughput import detect_peak_tflops, memory_gb, training_flops_per_token
from domino.train.timers import Timers

logger = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """The loss stayed non-finite for ``--max-nan-steps`` consecutive iterations."""


@dataclass
class TrainingResult:
    """What a finished run reports back to its caller (the CLI and the pipeline component)."""

    iteration: int
    consumed_samples: int
    final_train_loss: Optional[float]
    final_valid_loss: Optional[float]
    final_test_loss: Optional[float]
    tokens_per_s: Optional[float]
    checkpoint: Optional[str]


class _TimedIterator:
    """Wraps a data iterator so time spent waiting for batches lands in the ``batch-generator`` timer."""

    def __init__(self, iterator, timers: Timers) -> None:
        self.iterator, self.timers = iterator, timers

    def __iter__(self):
        return self

    def __next__(self):
        self.timers.start("batch-generator")
        try:
            return next(self.iterator)
        finally:
            self.timers.stop("batch-generator")


def _train_iters(config: DominoConfig, global_batch: int) -> int:
    t = config.train
    return t.train_iters if t.train_iters is not None else math.ceil(t.train_samples / global_batch)


def _set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def _zero_gradient_loss(module: torch.nn.Module) -> torch.Tensor:
    """A loss whose gradient is exactly zero for every parameter, free of the non-finite activations."""
    return sum((p * 0.0).sum() for p in module.parameters() if p.requires_grad)


def pretrain(config: DominoConfig, model_builder: Callable, dataset_builder: Callable, forward_step: Callable,
             padded_vocab_size: int, tokenizer=None) -> TrainingResult:
    """Trains according to ``config`` (call it on every rank; torch.distributed is set up here).

    Args:
        config: the resolved run configuration.
        model_builder: builds the (single-device-readable, TP-sharded) model.
        dataset_builder: builds train/valid/test datasets for the requested sample counts.
        forward_step: one micro-batch forward returning ``(output, loss_fn)``.
        padded_vocab_size: recorded in checkpoints so loading can check the shape.
        tokenizer: saved into every checkpoint when given.

    Raises:
        ConfigError: for settings that cannot work, before training starts.
        TrainingDivergedError: after ``--max-nan-steps`` consecutive non-finite losses.
    """
    engine_setup.initialize_runtime(config)
    world = dist.get_world_size()
    validate(config, world_size=world, for_training=True)
    # Fail on a garbage --load before building anything.
    resume_from, warm_start = checkpointing.find_checkpoint(config)
    tp_random.model_parallel_seed(config.train.seed)

    model = model_builder(config)
    engine = engine_setup.build_engine(model, config)
    iteration, consumed = 0, 0
    if resume_from is not None:
        meta = checkpointing.weights_io.read_checkpoint_meta(resume_from)
        checkpointing.check_compatible(meta, config, padded_vocab_size, resume_from, warm_start)
        iteration, consumed = checkpointing.load_checkpoint(engine, config, resume_from, weights_only=warm_start)
    elif config.checkpoint.load:
        logger.info("--load %s holds no checkpoint yet: starting from scratch", config.checkpoint.load)

    gbs = engine_setup.global_batch_size(config)
    gas = engine_setup.gradient_accumulation_steps(config)
    train_iters = _train_iters(config, gbs)
    t, lg = config.train, config.logging
    eval_samples = t.eval_iters * gbs if t.eval_interval or t.eval_iters else 0
    schedule = LearningRateSchedule.from_config(t, train_iters)

    # Every rank builds the datasets (index caches are built once, behind a world-wide barrier); only TP rank 0
    # reads batches and broadcasts them to its TP group.
    # Whether a split is empty is thus known on every rank, so all ranks agree on which evaluations run.
    is_data_rank = state.get_tensor_model_parallel_rank() == 0
    train_ds, valid_ds, test_ds = dataset_builder((train_iters * gbs, eval_samples, eval_samples))
    dp_rank, dp = state.get_data_parallel_rank(), state.get_data_parallel_world_size()
    mbs = t.micro_batch_size

    def loader(dataset, consumed_samples: int, workers: int):
        if dataset is None or not is_data_rank:
            return None
        return iter(build_pretraining_data_loader(dataset, consumed_samples, mbs, dp_rank, dp, workers))

    timers = Timers(lg.timing_log_level)
    train_iter = loader(train_ds, consumed, config.data.num_workers)
    train_iter = _TimedIterator(train_iter, timers) if train_iter is not None else None
    rank0 = dist.get_rank() == 0
    writer = MetricsWriter(lg.metrics_file, lg.tensorboard_dir, enabled=rank0)
    writer.drop_after(iteration)
    peak = lg.peak_tflops or detect_peak_tflops()
    flops_per_token = training_flops_per_token(config.model, padded_vocab_size)
    tokens_per_iter = gbs * config.model.seq_length

    paused = [0.0]  # seconds spent evaluating or saving, kept out of the throughput numbers

    def run_eval(split: str, dataset) -> Optional[float]:
        if t.eval_iters == 0 or dataset is None:
            return None
        started = time.perf_counter()
        loss = evaluate(forward_step, lambda: loader(dataset, 0, 0), engine, t.eval_iters)
        paused[0] += time.perf_counter() - started
        logger.info("%s loss at iteration %d: lm loss %.4E | ppl %.4E", split, iteration, loss, perplexity(loss))
        writer.write({"eval": split, "iteration": iteration, "lm_loss": loss, "ppl": perplexity(loss)})
        return loss

    def save() -> str:
        started = time.perf_counter()
        path = checkpointing.save_checkpoint(engine, config, iteration, consumed, padded_vocab_size, tokenizer)
        paused[0] += time.perf_counter() - started
        return str(path)

    logger.info("training %d iterations: global batch %d (micro %d x DP %d x accumulation %d), TP %d, "
                "Domino chunks %d, ZeRO %d", train_iters, gbs, mbs, dp, gas,
                state.get_tensor_model_parallel_world_size(), config.parallel.domino_chunks, config.parallel.zero_stage)
    engine.train()
    interval_loss, interval_iters, interval_start = 0.0, 0, time.perf_counter()
    skipped_total = nan_streak = 0
    grad_norm = None
    last_train_loss = last_valid = tokens_per_s = None
    checkpoint_path, saved_at = None, None
    run_start, start_iteration = time.perf_counter(), iteration
    interval_start_iter = iteration

    while iteration < train_iters:
        lr = schedule.lr_at(iteration)
        _set_lr(engine, lr)
        iteration_loss, finite = 0.0, True
        timers.start("forward-backward")
        for micro in range(gas):
            timers.start("forward")
            output, loss_fn = forward_step(train_iter, engine)
            loss, stats = loss_fn(output)
            timers.stop("forward")
            averaged = float(stats["lm loss"])
            finite = finite and math.isfinite(averaged)
            iteration_loss += averaged / gas
            timers.start("backward")
            # A non-finite loss (agreed by all ranks: it is the DP average) contributes zero gradients.
            engine.backward(loss if finite else _zero_gradient_loss(engine.module))
            timers.stop("backward")
            if micro == gas - 1:
                timers.stop("forward-backward")
                if not finite:
                    _set_lr(engine, 0.0)  # skip the update; only the Adam moments decay once
                timers.start("optimizer")
                if engine_setup.clips_itself(config):
                    grad_norm = engine_setup.clip_gradients(engine, t.clip_grad)
            engine.step()
        timers.stop("optimizer")
        iteration += 1
        consumed += gbs
        if finite:
            nan_streak = 0
            interval_loss += iteration_loss
            interval_iters += 1
            last_train_loss = iteration_loss
        else:
            nan_streak += 1
            skipped_total += 1
            logger.warning("iteration %d: non-finite loss, update skipped (%d in a row)", iteration, nan_streak)
            if nan_streak >= t.max_nan_steps:
                raise TrainingDivergedError(
                    f"the loss was NaN/inf for {nan_streak} consecutive iterations (up to iteration {iteration}; "
                    f"--max-nan-steps {t.max_nan_steps}); last finite loss {last_train_loss}. Lower --lr, "
                    "use --bf16 instead of --fp16, or check the data.")

        if iteration % lg.log_interval == 0 or iteration == train_iters:
            elapsed = time.perf_counter() - interval_start - paused[0]
            n = max(iteration - interval_start_iter, 1)
            iter_time = elapsed / n
            tokens_per_s = tokens_per_iter / iter_time
            tflops = flops_per_token * tokens_per_s / world / 1e12
            if not engine_setup.clips_itself(config):
                grad_norm = engine.get_global_grad_norm()
            scaler = getattr(engine.optimizer, "loss_scaler", None)
            record = {
                "iteration": iteration, "consumed_samples": consumed,
                "lm_loss": interval_loss / interval_iters if interval_iters else float("nan"),
                "lr": lr, "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "loss_scale": float(scaler.cur_scale) if scaler is not None and t.fp16 else None,
                "skipped_iterations": skipped_total + (int(engine.skipped_steps) if t.fp16 else 0),
                "iteration_time_s": iter_time, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
                "mfu": tflops / peak if peak else None, "memory_gb": memory_gb(),
                "eta_s": iter_time * (train_iters - iteration),
            }
            totals = timers.pop_all()
            if totals:
                record["timers_ms_per_iter"] = {k: 1000 * v / n for k, v in totals.items()}
            writer.write(record)
            logger.info("%s", format_iteration_line(record, train_iters))
            if totals:
                logger.info("%s", Timers.format(totals, n))
            interval_loss, interval_iters, interval_start = 0.0, 0, time.perf_counter()
            interval_start_iter, paused[0] = iteration, 0.0

        if t.eval_interval and iteration % t.eval_interval == 0 and iteration < train_iters:
            last_valid = run_eval("valid", valid_ds)
        c = config.checkpoint
        if c.save and c.save_interval and iteration % c.save_interval == 0:
            checkpoint_path, saved_at = save(), iteration
        if t.exit_interval and iteration % t.exit_interval == 0:
            logger.info("--exit-interval %d reached at iteration %d", t.exit_interval, iteration)
            break

    if config.checkpoint.save and saved_at != iteration:
        checkpoint_path = save()
    if t.eval_interval or t.eval_iters:
        last_valid = run_eval("valid", valid_ds)
    last_test = run_eval("test", test_ds)
    writer.close()
    logger.info("done: %d iterations in %.1f s", iteration - start_iteration, time.perf_counter() - run_start)
    return TrainingResult(iteration, consumed, last_train_loss, last_valid, last_test, tokens_per_s, checkpoint_path)
