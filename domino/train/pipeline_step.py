"""One optimizer step of a pipelined run: the 1F1B (or interleaved 1F1B) schedule, the gradients made whole,
DeepSpeed's step.

With ``--pipeline-model-parallel-size`` > 1 the schedule of :mod:`domino.pipeline.schedule` runs every forward and
backward of the step, so DeepSpeed never sees a loss: the engine is built with one "micro-batch" per step (the
step's micro-batches together, :func:`domino.train.engine.deepspeed_config`) and its hooks that reduce gradients
inside its own backward off, and here, after the schedule, in this order:

1. the tied embeddings' gradient is summed over the first and last stage
   (:func:`domino.pipeline.gradients.sync_tied_embeddings`);
2. the gradients are averaged over the data-parallel replicas, so the norm is that of the step's gradient;
3. domino clips them with the norm over every stage (:func:`domino.train.engine.clip_gradients`);
4. ZeRO-1 moves them into its partitions (``engine.allreduce_gradients``: DeepSpeed's ``reduce_gradients``, the
   call its own PipelineEngine makes, ``_exec_reduce_grads`` in deepspeed 0.19.8 ``runtime/pipe/engine.py``;
   the replicas' gradients are already equal, so its averaging changes nothing), and the optimizer steps.

Step 2 costs one more data-parallel all-reduce of the gradients than a run without pipeline stages under ZeRO-1
(stage 0 reduces only here); it is what lets the norm be taken before ZeRO partitions the gradients.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from domino.config import ConfigError, DominoConfig
from domino.pipeline.gradients import sync_tied_embeddings
from domino.pipeline.schedule import StageSchedule
from domino.runtime import state
from domino.train import engine as engine_setup
from domino.train.gpt_recipe import average_across_data_parallel_group

logger = logging.getLogger(__name__)


def average_over_data_parallel(params: List[torch.nn.Parameter]) -> None:
    """Replaces every gradient of ``params`` by its mean over the data-parallel replicas (one flat all-reduce)."""
    dp = state.get_data_parallel_world_size()
    grads = [p.grad for p in params if p.grad is not None]
    if dp == 1 or not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=state.get_data_parallel_group())  # synchronous: the norm reads it next
    flat /= dp
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


class PipelineStep:
    """Runs a pipelined run's optimizer steps.

    Args:
        config: the run's configuration.
        engine: the DeepSpeed engine around this rank's stage.
        get_batch: ``get_batch(data_iterator) -> {tokens, labels, loss_mask, attention_mask, position_ids}`` for one
            micro-batch (:meth:`domino.train.gpt_recipe.GPTRecipe.batch`).
    """

    def __init__(self, config: DominoConfig, engine, get_batch: Optional[Callable[..., Dict[str, torch.Tensor]]],
                 micro_batches: int) -> None:
        if get_batch is None:
            raise ConfigError("--pipeline-model-parallel-size > 1 needs pretrain(get_batch=...): the pipeline "
                              "schedule, not forward_step, runs the stages")
        self.config, self.engine, self.get_batch = config, engine, get_batch
        self.micro_batches = micro_batches
        self._schedules: Dict[int, StageSchedule] = {}
        self.schedule = self._schedule(micro_batches)
        chunks, indices = self.schedule.chunks, self.schedule.indices
        logger.info("pipeline stage %d of %d: %s, virtual stages %s (layers %s)",
                    state.get_pipeline_model_parallel_rank(), state.get_pipeline_model_parallel_world_size(),
                    "1F1B" if len(chunks) == 1 else f"interleaved 1F1B over {self.schedule.num_virtual_stages} "
                    "virtual stages", ", ".join(map(str, indices)),
                    "; ".join(",".join(map(str, chunk.layers.indices)) for chunk in chunks))

    def _schedule(self, micro_batches: int) -> StageSchedule:
        """The (1F1B or interleaved) schedule of a step of ``micro_batches``, one per count a batch-size ramp reaches (a stage's
        buffers are sized for its schedule's micro-batch count)."""
        if micro_batches not in self._schedules:
            m, t = self.config.model, self.config.train
            self._schedules[micro_batches] = StageSchedule(
                self.engine.module, num_microbatches=micro_batches, micro_batch_size=t.micro_batch_size,
                seq_length=m.seq_length, hidden_size=m.hidden_size,
                sequence_parallel=self.config.parallel.sequence_parallel,
                dtype=next(self.engine.module.parameters()).dtype)
        return self._schedules[micro_batches]

    def _step_batch(self, data_iterator, count: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """``count`` micro-batches (default: a step's), each tensor concatenated along the batch (the schedule
        splits them again)."""
        micro = [self.get_batch(data_iterator) for _ in range(count or self.micro_batches)]
        return {name: None if micro[0][name] is None else torch.cat([mb[name] for mb in micro])
                for name in micro[0]}

    def __call__(self, data_iterator, timers, micro_batches: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """One step of ``micro_batches`` per data-parallel rank. Returns the mean loss over the step's micro-batches
        averaged over the replicas, the gradient norm (0-d tensors on the device), and the optimizer's 0/1 skip flag
        of a non-finite norm (the ZeRO optimizer's device flag at ZeRO 1/2; None where DeepSpeed decides on the
        host)."""
        timers.start("forward-backward")
        batch = self._step_batch(data_iterator, micro_batches)
        loss = self._schedule(micro_batches).train_step(batch["tokens"], batch["labels"], batch["loss_mask"],
                                                        batch["position_ids"], batch["attention_mask"])
        timers.stop("forward-backward")
        timers.start("optimizer")
        module = self.engine.module
        sync_tied_embeddings(module)
        average_over_data_parallel(list(module.parameters()))
        grad_norm = engine_setup.clip_gradients(self.engine, self.config.train.clip_grad)
        skipped = None
        if engine_setup.zero_stage(self.config) == 0:
            skipped = engine_setup.flag_overflow(self.engine, grad_norm)  # fused AdamW skips on the device
        else:
            self.engine.allreduce_gradients()
        self.engine.step()
        if skipped is None:  # the ZeRO optimizer's own skip, decided on the device (domino.train.zero_step)
            skipped = engine_setup.device_skip_flag(self.engine)
        timers.stop("optimizer")
        return average_across_data_parallel_group(loss), grad_norm, skipped

    @torch.no_grad()
    def evaluate(self, make_iterator: Callable, eval_iters: int) -> float:
        """The mean loss of ``eval_iters`` micro-batches of a fresh iterator, averaged over the replicas: the number
        :func:`domino.train.evaluation.evaluate` gives at one stage. Runs them a step's worth at a time (whatever is
        left in the last group)."""
        module = self.engine.module
        was_training = module.training
        module.eval()
        iterator, total, done = make_iterator(), None, 0
        while done < eval_iters:
            count = min(self.micro_batches, eval_iters - done)
            batch = self._step_batch(iterator, count)
            loss = self.schedule.eval_step(batch["tokens"], batch["labels"], batch["loss_mask"],
                                           batch["position_ids"], batch["attention_mask"])
            loss = average_across_data_parallel_group(loss).double() * count
            total = loss if total is None else total + loss  # summed on the device: one host read at the end
            done += count
        if was_training:
            module.train()
        return float(total) / eval_iters if total is not None else 0.0
