"""The loop of one training run: steps, NaN accounting, interval logging, evaluation, saving and the goodput
ledger's records (:class:`Trainer`, built and run by :func:`domino.train.pretrain.pretrain`)."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from domino.checkpoint import checkpointing, on_disk
from domino.checkpoint.manager import CheckpointManager
from domino.config import DominoConfig, config_to_dict
from domino.config.batch_schedule import batch_schedule
from domino.data.loader import build_pretraining_data_loader
from domino.goodput.accounting import account, running_figures
from domino.goodput.ledger import Ledger
from domino.runtime.comm_timing import pop_modelled_comm_seconds
from domino.runtime.hang_watch import HangWatch
from domino.runtime.mesh import ParallelMesh, collective_device
from domino.runtime.agreement import agree, hosts, is_lost_peer_error, lost_peer_error
from domino.optim.deepspeed_config import pipelined
from domino.optim.interface import TrainingOptimizer
from domino.train import schedule_check
from domino.train.evaluation import evaluate, perplexity
from domino.train.fault_injection import maybe_raise_in_step
from domino.train.interval_stats import IntervalReading, IntervalStats
from domino.train.metrics import MetricsWriter, format_iteration_line
from domino.train.preemption import StopSignal, startup_warnings
from domino.train.schedules import LearningRateSchedule
from domino.train.stragglers import StragglerDetector
from domino.train.throughput import detect_peak_tflops, memory_gb, training_flops_per_token
from domino.train.timers import TimedIterator, Timers

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
    interrupted: bool = False
    """True when ``--exit-signal-handler`` stopped the run early on SIGTERM (after saving)."""


class Trainer:
    """The loop of one run: steps, NaN accounting, interval logging, evaluation and saving."""

    def __init__(self, config: DominoConfig, mesh: ParallelMesh, checkpoints: CheckpointManager,
                 optimizer: TrainingOptimizer,
                 dataset_builder: Callable, forward_step: Callable, padded_vocab_size: int, tokenizer,
                 get_batch: Optional[Callable] = None, schedule: Optional[LearningRateSchedule] = None,
                 ledger: Optional[Ledger] = None) -> None:
        self.config, self.optimizer, self.forward_step = config, optimizer, forward_step
        self.ledger = ledger or Ledger(None, enabled=False)
        self.mesh = mesh
        self.tp_link = mesh.tp.link  # the emulated TP link (DOMINO_SIMULATED_NETWORK), whose time is logged
        self.comm = mesh.tp.timer  # the TP collectives' blocked time (the comm-wait timer), read per interval
        self.padded_vocab_size, self.tokenizer = padded_vocab_size, tokenizer
        t, lg = config.train, config.logging
        self.batches = batch_schedule(config, mesh.dp.size)  # the batch of each iteration
        self.pipeline = None
        if pipelined(config):
            # Imported only here: a run without stages never needs torch.distributed.pipelining and its schedules.
            from domino.train.pipeline_step import PipelineStep

            self.pipeline = PipelineStep(config, mesh, optimizer, get_batch, self.batches.micro_batches_per_step)
        self.gbs = self.batches.global_batch_size
        self.train_iters = t.train_iters if t.train_iters is not None else self.batches.train_iters(t.train_samples)
        self.schedule = schedule or LearningRateSchedule.from_config(t, self.train_iters, self.gbs)
        eval_samples = t.eval_iters * self.gbs if t.eval_interval or t.eval_iters else 0
        # Every rank builds the datasets (index caches are built once, behind a world-wide agreement), so every
        # rank knows which splits are empty; only TP rank 0 reads batches and broadcasts them to its TP group, and
        # with pipeline stages only on a stage that reads batches (a middle one does not: PipelineStep).
        self.is_data_rank = mesh.tp.rank == 0 and (
            self.pipeline is None or self.pipeline.reads_batches)
        self.train_ds, self.valid_ds, self.test_ds = agree("building the datasets", lambda: dataset_builder(
            (self.batches.consumed_samples_after(self.train_iters), eval_samples, eval_samples)))
        self.hosts = hosts()  # to name the node of a rank lost later
        self.stragglers = StragglerDetector(lg.log_straggler, self.hosts, config.parallel.distributed_timeout_minutes)
        self.timers = Timers(lg.timing_log_level)
        self.writer = MetricsWriter(lg.metrics_file, lg.tensorboard_dir, enabled=dist.get_rank() == 0,
                                    log_timers=lg.log_timers_to_tensorboard, metrics_port=lg.metrics_port,
                                    train_iters=self.train_iters)
        self.peak = lg.peak_tflops or detect_peak_tflops(fp8=t.fp8_format is not None)
        self.flops_per_token = training_flops_per_token(config.model, padded_vocab_size)
        self.paused = 0.0  # seconds spent evaluating or saving, kept out of the throughput numbers
        self.device = collective_device(mesh.tp.process_group)
        self.stats = IntervalStats(self.device, t.max_nan_steps)
        self.grad_norm: Optional[torch.Tensor] = None  # on the device; read at log intervals
        self.last_train_loss: Optional[float] = None
        self.saver = checkpoints.saver()

    def _loader(self, dataset, consumed_samples: int, workers: int):
        if dataset is None or not self.is_data_rank:
            return None
        return iter(build_pretraining_data_loader(
            dataset, consumed_samples, self.config.train.micro_batch_size, self.mesh.dp.rank,
            self.mesh.dp.size, workers))

    def _step(self, train_iter, batch: int) -> torch.Tensor:
        """One optimizer step over a ``batch``-sample global batch; returns the mean loss, a 0-d tensor on the device.

        Nothing here reads a tensor value on the host (each read would wait for the device to drain): a
        non-finite loss makes non-finite gradients, and the optimizer skips that update by itself: DeepSpeed's at
        ZeRO 1/2 from a device flag (:mod:`~domino.optim.bf16_step`, :mod:`~domino.optim.zero_step`), torch's fused
        AdamW at ZeRO 0 (fp32, or bf16/fp16 on fp32 masters: :mod:`~domino.optim.mixed_precision`) from
        ``found_inf`` (:func:`domino.optim.clipping.flag_overflow`).
        """
        optimizer, timers = self.optimizer, self.timers
        self.batch = batch  # Megatron logs the batch of the iteration at the log point as batch-size
        per_micro_batch = self.batches.micro_batch_size * self.batches.data_parallel_size
        if self.pipeline is not None:  # the schedule runs every micro-batch (domino.train.pipeline_step)
            loss, self.grad_norm, skipped = self.pipeline(train_iter, timers, batch // per_micro_batch)
            if skipped is not None:
                self.stats.add_optimizer_skip(skipped)
            return loss
        iteration_loss = torch.zeros((), device=self.device)
        timers.start("forward-backward")
        for last in optimizer.micro_batches(batch, per_micro_batch):
            timers.start("forward")
            output, loss_fn = self.forward_step(train_iter, optimizer.forward_model)
            loss, stats = loss_fn(output)
            timers.stop("forward")
            iteration_loss += stats["lm loss"].detach()  # the DP average, identical on every rank
            timers.start("backward")
            optimizer.backward(loss)
            timers.stop("backward")
        timers.stop("forward-backward")
        timers.start("optimizer")
        outcome = optimizer.step()
        self.grad_norm = outcome.grad_norm
        if outcome.skipped is not None:  # skipped on the device: counted with the interval's numbers
            self.stats.add_optimizer_skip(outcome.skipped)
        timers.stop("optimizer")
        return iteration_loss / (batch // per_micro_batch)

    def _check_nan_streak(self, iteration: int, iterations: int, reading: IntervalReading) -> None:
        if reading.non_finite:
            logger.warning("iterations %d-%d: %d non-finite losses, updates skipped (%d in a row)",
                           iteration - iterations + 1, iteration, reading.non_finite, reading.nan_streak)
        limit = self.config.train.max_nan_steps
        if reading.streak_limit_at is not None:
            raise TrainingDivergedError(
                f"the loss was NaN/inf for {limit} consecutive iterations (up to iteration "
                f"{reading.streak_limit_at}; --max-nan-steps {limit}); last finite loss {reading.last_finite_loss}. "
                "Lower --lr, use --bf16 instead of --fp16, or check the data.")

    def _log(self, iteration: int, consumed: int, lr: float, iterations: int, samples: int, elapsed: float) -> float:
        """Reads the interval's numbers from the device, writes its record and log line; returns tokens/s.

        Raises:
            TrainingDivergedError: when the loss stayed non-finite for ``--max-nan-steps`` iterations.
        """
        optimizer = self.optimizer
        reading = self.stats.read()
        if reading.last_finite_loss is not None:
            self.last_train_loss = reading.last_finite_loss
        self._check_nan_streak(iteration, iterations, reading)
        iter_time = (elapsed - self.paused) / max(iterations, 1)
        blocked = self.comm.pop_seconds()  # host time blocked in TP collectives (sync ones, Domino's waits)
        tokens_per_s = samples / max(iterations, 1) * self.config.model.seq_length / iter_time
        tflops = self.flops_per_token * tokens_per_s / dist.get_world_size() / 1e12
        record = {
            "iteration": iteration, "consumed_samples": consumed, "batch_size": self.batch,
            "lm_loss": reading.mean_loss,
            "lr": lr, "grad_norm": float(self.grad_norm) if self.grad_norm is not None else None,
            "loss_scale": optimizer.loss_scale(),
            # DeepSpeed's wrappers count their own skips (after their own host read of the overflow flag).
            "skipped_iterations": reading.optimizer_skips + optimizer.host_skipped_steps,
            "iteration_time_s": iter_time, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
            "mfu": tflops / self.peak if self.peak else None, "memory_gb": memory_gb(),
            "eta_s": iter_time * (self.train_iters - iteration),
            **running_figures(self.ledger.events if self.ledger.path else [], time.time()),
            **self.stragglers.measure(elapsed - self.paused, blocked, iterations),
        }
        if record.get("stragglers"):  # the interval ran at the slowest rank's pace: what that cost, for the ledger
            compute = record["compute_s_by_rank"]
            self.ledger.record("straggler", seconds=iterations * (max(compute) - statistics.median(compute)),
                               ranks=[s["rank"] for s in record["stragglers"]])
        self.timers.add("comm-wait", blocked)
        for site, seconds in self.comm.pop_by_site().items():  # the breakdown, at --timing-log-level 2
            self.timers.add(f"comm-wait: {site}", seconds)
        modelled = pop_modelled_comm_seconds(self.tp_link)  # the emulated link's time (DOMINO_SIMULATED_NETWORK)
        if modelled:
            self.timers.add("comm-modelled", modelled)
        totals = self.timers.pop_all()
        if totals:
            record["timers_ms_per_iter"] = {k: 1000 * v / max(iterations, 1) for k, v in totals.items()}
        self.writer.write(record)
        logger.info("%s", format_iteration_line(record, self.train_iters))
        if totals:
            logger.info("%s", Timers.format(totals, iterations))
        self.paused = 0.0
        return tokens_per_s

    def _evaluate(self, split: str, dataset, iteration: int, consumed: int) -> Optional[float]:
        if self.config.train.eval_iters == 0 or dataset is None:
            return None
        self.hang.progress(iteration, "evaluate")
        started, training_comm = time.perf_counter(), self.comm.pop_seconds()
        training_modelled, training_sites = pop_modelled_comm_seconds(self.tp_link), self.comm.pop_by_site()
        make_iterator, iters = lambda: self._loader(dataset, 0, 0), self.config.train.eval_iters
        loss = (evaluate(self.forward_step, make_iterator, self.optimizer.forward_model, iters) if self.pipeline is None
                else self.pipeline.evaluate(make_iterator, iters))
        self.comm.pop_seconds(), pop_modelled_comm_seconds(self.tp_link), self.comm.pop_by_site()  # not training's
        self.timers.add("comm-wait", training_comm)
        for site, seconds in training_sites.items():
            self.timers.add(f"comm-wait: {site}", seconds)
        if training_modelled:
            self.timers.add("comm-modelled", training_modelled)
        self.paused += time.perf_counter() - started
        self.ledger.record("evaluation", split=split, seconds=time.perf_counter() - started)
        self.hang.progress(iteration, "step")
        logger.info("%s loss at iteration %d: lm loss %.4E | ppl %.4E", split, iteration, loss, perplexity(loss))
        self.writer.write({"eval": split, "iteration": iteration, "consumed_samples": consumed, "lm_loss": loss,
                           "ppl": perplexity(loss)})
        return loss

    def _save(self, iteration: int, consumed: int) -> str:
        self.hang.progress(iteration, "save")
        started = time.perf_counter()
        path = self.saver.save(self.optimizer, iteration, consumed, self.padded_vocab_size, self.tokenizer, self.gbs,
                               schedule_check.record(self.schedule, self.config, self.train_iters,
                                                     self.mesh.dp.size))
        self.paused += time.perf_counter() - started
        self.ledger.record("save", iteration=iteration, blocking_s=time.perf_counter() - started)
        self.hang.progress(iteration, "step")
        if not self.config.checkpoint.async_save:
            self._committed(path)
        return str(path)

    def _commit_finished_save(self) -> None:
        """Every step: an asynchronous save whose parts every rank has written is committed now."""
        started = time.perf_counter()
        committed = self.saver.poll()
        if committed is not None:
            self.paused += time.perf_counter() - started
            self._committed(committed)

    def _committed(self, path) -> None:
        """Records a committed checkpoint (``iter_NNNNNNN``) in the ledger; None (nothing committed) is ignored."""
        if path is not None:
            self.ledger.record("durable", iteration=on_disk.tag_iteration(Path(path).name))

    def run(self, iteration: int, consumed: int, resumed_checkpoint: Optional[str] = None) -> TrainingResult:
        """Trains from ``iteration`` (``consumed`` samples done, ``resumed_checkpoint`` not saved again) on."""
        self.completed = iteration  # the last iteration every rank finished, for a lost-peer report
        self.stop = StopSignal(self.config.train.exit_signal_handler, self.config.parallel.distributed_timeout_minutes)
        p = self.config.parallel
        self.hang = HangWatch(p.hang_timeout_s, 60.0 * p.distributed_timeout_minutes, on_hang=lambda line: (
            self.ledger.record("end", how="hung", iteration=self.completed, loop_end=self.hang.progressed_at)),
            timers={"tp": self.mesh.tp.timer, "cp": self.mesh.cp.timer})
        if dist.get_rank() == 0:
            for warning in startup_warnings(self.config, self.optimizer):
                logger.warning("%s", warning)
        how = "failed"
        self.loop_end: Optional[float] = None  # when the last step ended, for the ledger
        try:
            result = self._run(iteration, consumed, resumed_checkpoint)
            how = "sigterm" if result.interrupted else "finished"
            return result
        except RuntimeError as error:
            if not is_lost_peer_error(error):
                raise
            raise lost_peer_error(error, self.hosts, self.completed, checkpointing.resume_hint(self.config)) from None
        finally:
            self.hang.close()
            self.stop.close(wait=how != "failed")
            self._end_attempt(how)

    def _end_attempt(self, how: str) -> None:
        """The ledger's last record of this attempt, and its one line of goodput (rank 0)."""
        self.ledger.record("end", how=how, iteration=self.completed,
                           loop_end=self.loop_end if self.loop_end is not None else time.time())
        if self.ledger.path is None:
            return
        try:
            logger.info("%s", account(self.ledger.events).line())
        except (TypeError, ValueError, KeyError) as error:  # a damaged ledger: the report never changes the ending
            logger.warning("goodput not accounted (%s: %s)", type(error).__name__, error)

    def _run(self, iteration: int, consumed: int, resumed_checkpoint: Optional[str]) -> TrainingResult:
        config, t, lg, c = self.config, self.config.train, self.config.logging, self.config.checkpoint
        left = iteration < self.train_iters  # not after a restart past the end (a pod restarted in the final eval)
        train_iter = self._loader(self.train_ds, consumed, config.data.num_workers) if left else None
        if not left:
            logger.info("nothing left to train at iteration %d of %d: evaluating", iteration, self.train_iters)
        train_iter = TimedIterator(train_iter, self.timers) if train_iter is not None else None
        self.writer.drop_after(iteration)
        self.writer.track(config_to_dict(config), lg, c.save, iteration, {
            "world_size": dist.get_world_size(), "global_batch_size": self.gbs, "train_iters": self.train_iters,
            "padded_vocab_size": self.padded_vocab_size})
        logger.info("training %d iterations: global batch %d (micro %d x DP %d x accumulation %d), TP %d, CP %d, "
                    "Domino chunks %d, ZeRO %d", self.train_iters, self.batches.global_batch_size_at(consumed),
                    t.micro_batch_size, self.mesh.dp.size, self.batches.num_micro_batches_at(consumed),
                    self.mesh.tp.size, self.mesh.cp.size, config.parallel.domino_chunks, config.parallel.zero_stage)
        self.optimizer.module.train()
        # Set-up collectives are not part of any interval.
        self.comm.pop_seconds(), pop_modelled_comm_seconds(self.tp_link), self.comm.pop_by_site()
        run_start, start_iteration = time.perf_counter(), iteration
        self.ledger.record("training", iteration=iteration)
        interval_start, interval_first, interval_consumed = time.perf_counter(), iteration, consumed
        last_valid, tokens_per_s, checkpoint_path = None, None, resumed_checkpoint
        saved_at = iteration if resumed_checkpoint else None

        while iteration < self.train_iters:
            batch = self.batches.global_batch_size_at(consumed)
            lr = self.schedule.lr_at_samples(consumed)
            self.optimizer.set_lr(lr)
            maybe_raise_in_step(iteration + 1, dist.get_rank())  # DOMINO_FAULT_INJECT=raise-in-step@N:R only
            self.stats.add(self._step(train_iter, batch), iteration + 1)
            iteration += 1
            self.completed = iteration
            self.hang.progress(iteration)
            if iteration == start_iteration + 1:
                self.ledger.record("first_step", iteration=iteration)
            consumed += batch
            logged = iteration % lg.log_interval == 0 or iteration == self.train_iters
            if logged:
                tokens_per_s = self._log(iteration, consumed, lr, iteration - interval_first,
                                         consumed - interval_consumed, time.perf_counter() - interval_start)
                self.ledger.record("progress", iteration=iteration)
                interval_start, interval_first, interval_consumed = time.perf_counter(), iteration, consumed
            if t.eval_interval and iteration % t.eval_interval == 0 and iteration < self.train_iters:
                last_valid = self._evaluate("valid", self.valid_ds, iteration, consumed)
            self._commit_finished_save()
            # Megatron's train() also saves when the number of micro-batches changes (a step-up of the batch).
            next_batch = self.batches.global_batch_size_at(consumed)
            step_up = iteration < self.train_iters and next_batch != batch
            if step_up:
                logger.info("iteration %d: global batch %d -> %d at %d samples", iteration, batch, next_batch, consumed)
            if c.save and (c.save_interval and iteration % c.save_interval == 0 or step_up):
                checkpoint_path, saved_at = self._save(iteration, consumed), iteration
            if t.exit_interval and iteration % t.exit_interval == 0:
                logger.info("--exit-interval %d reached at iteration %d", t.exit_interval, iteration)
                break
            if self.stop.requested():  # every step: a SIGTERM on any rank, agreed one step later
                self.loop_end = time.time()
                logger.warning("SIGTERM: saving at iteration %d and exiting", iteration)
                if c.save and saved_at != iteration:
                    checkpoint_path = self._save(iteration, consumed)
                self._committed(self.saver.wait())  # the save in flight is committed before the process exits
                if c.save and dist.get_rank() == 0:
                    logger.warning("SIGTERM: checkpoint %s durable %.2f s after the signal", checkpoint_path,
                                   self.stop.since_signal_s())
                self.writer.close(completed=False)
                return TrainingResult(iteration, consumed, self.last_train_loss, last_valid, None, tokens_per_s,
                                      checkpoint_path, interrupted=True)

        self.loop_end = time.time()
        if c.save and saved_at != iteration:
            checkpoint_path = self._save(iteration, consumed)
        if t.eval_interval or t.eval_iters:
            last_valid = self._evaluate("valid", self.valid_ds, iteration, consumed)
        last_test = self._evaluate("test", self.test_ds, iteration, consumed)
        self._committed(self.saver.wait())  # an asynchronous final save is written while the model is evaluated
        self.writer.close()
        logger.info("done: %d iterations in %.1f s", iteration - start_iteration, time.perf_counter() - run_start)
        return TrainingResult(iteration, consumed, self.last_train_loss, last_valid, last_test, tokens_per_s,
                              checkpoint_path)
