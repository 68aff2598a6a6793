"""One optimizer step of a pipelined run: the 1F1B (or interleaved 1F1B) schedule, the gradients made whole,
the optimizer's step.

With ``--pipeline-model-parallel-size`` > 1 the schedule of :mod:`domino.pipeline.schedule` runs every forward and
backward of the step, so DeepSpeed never sees a loss: the engine is built with one "micro-batch" per step (the
step's micro-batches together, :func:`domino.optim.deepspeed_config.deepspeed_config`) and its hooks that reduce gradients
inside its own backward off, and here, after the schedule, in this order:

1. the tied embeddings' gradient is summed over the first and last stage
   (:func:`domino.pipeline.gradients.sync_tied_embeddings`);
2. the gradients are averaged over the data-parallel replicas, so the norm is that of the step's gradient;
3. domino clips them with the norm over every stage (:func:`domino.optim.clipping.clip_gradients`);
4. ZeRO-1 takes its partition of them as they are, with no collective
   (:func:`domino.optim.zero_step.take_reduced_gradients`: each rank keeps its own slice, where DeepSpeed's
   ``reduce_gradients``, the call its own PipelineEngine makes, ``_exec_reduce_grads`` in deepspeed 0.19.8
   ``runtime/pipe/engine.py``, would all-reduce the already equal gradients once more), and the optimizer steps.

With ``--overlap-grad-reduce`` step 2 is launched bucket by bucket from the schedule's backward and only waited
for here (:mod:`domino.pipeline.grad_overlap`; the tied copy is averaged after step 1, as before). At ZeRO 0 in
fp32 it always is, in the optimizer's own gradient buckets (:meth:`domino.optim.interface.TrainingOptimizer.
gradient_buckets`), the same path a run without stages takes, and step 4 is torch's AdamW alone.

Step 2 is the step's one data-parallel reduction of the gradients, as in a run without pipeline stages: an
all-reduce rather than ZeRO-1's reduction into partitions, so the norm is taken over the whole stage before ZeRO
partitions the gradients, which step 4 then only slices.

With ``--bf16`` the same steps run on the fp32 gradient buffers of DeepSpeed's BF16_Optimizer, into which its
per-gradient hooks added each micro-batch's bf16 gradient during the schedule's backward
(:meth:`_main_gradient_step`); the buffers are the step's gradients, averaged in step 2, and DeepSpeed's step reads
them as they are (nothing reduces them again). At ZeRO 0 (:mod:`domino.optim.mixed_precision`, bf16 or fp16) they
are the optimizer's fp32 main-gradient buckets, whose DP mean the backward launches as in fp32.

With ``--fp16`` the last stage multiplies each micro-batch's loss by the optimizer's dynamic loss scale, a device
tensor, inside the schedule (:attr:`domino.pipeline.schedule.StageSchedule.loss_scale`: the schedule runs the
backward, so the optimizer's own ``backward``, which would scale it too, is never called), and the gradients are
clipped still scaled by the unscaled norm over every stage. At ZeRO 1 (DeepSpeed's ZeRO optimizer, whose step
:mod:`domino.optim.zero_step` decides on the device) the ZeRO step unscales them and agrees the overflow over
every stage (the pipeline-group max of the skip flag, after DeepSpeed's over DP and TP). At ZeRO 0 the clipping
makes every main gradient NaN when that norm is not finite (it is summed over the stages, so it is the same on
each), :meth:`domino.optim.mixed_precision.MixedPrecisionAdamW.step_reduced` divides them by the scale and the
fused AdamW skips on the non-finite norm. Either way every stage skips and updates its scale alike. Only the
first and last stage read batches (:func:`stage_reads_batches`).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from domino.config import ConfigError, DominoConfig
from domino.pipeline.grad_overlap import OverlappedGradReduce
from domino.pipeline.gradients import sync_tied_embeddings, tied_embedding_weight
from domino.pipeline.schedule import StageSchedule
from domino.runtime.mesh import ParallelMesh
from domino.optim.clipping import clip_gradients
from domino.optim.interface import TrainingOptimizer
from domino.parallel.context_split import sum_over_context
from domino.train.gpt_recipe import average_across_data_parallel_group

logger = logging.getLogger(__name__)


def average_over_data_parallel(grads: List[torch.Tensor], mesh: ParallelMesh) -> None:
    """Replaces every one of ``grads`` by its mean over the data-parallel replicas of ``mesh``, summed over its
    context-parallel ranks (shares of one loss): one flat all-reduce over DP x CP, divided by DP."""
    if mesh.dp_cp.size == 1 or not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=mesh.dp_cp.process_group)  # synchronous: the norm reads it next
    flat /= mesh.dp.size
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


#: The tensors a micro-batch gives (:meth:`domino.train.gpt_recipe.GPTRecipe.batch`).
BATCH_FIELDS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def stage_reads_batches(config: DominoConfig, first: bool, last: bool) -> bool:
    """Whether a pipeline stage reads batches from the data loader: the first (tokens, positions) and the last
    (labels, loss mask), as Megatron's ``get_batch`` reads nothing on a middle stage (Megatron-LM d98e8a64
    ``pretrain_gpt.py``: ``if not is_first_or_last_pipeline_stage(vp_stage) and ... not has_cu_seqlens: return
    [None for _ in BATCH_KEYS]``, its middle stages reading only the document boundaries of packed sequences). So
    here: a middle stage reads batches only under ``--reset-position-ids`` or ``--reset-attention-mask``, whose
    positions and masks follow the documents of the tokens (every stage's layers use them)."""
    d = config.data
    return first or last or d.reset_position_ids or d.reset_attention_mask


def fp16_loss_scale(config: DominoConfig, optimizer: TrainingOptimizer) -> Optional[torch.Tensor]:
    """Under ``--fp16`` the 0-d device tensor of the optimizer's dynamic loss scale (updated in place by each
    step), else None.

    Raises:
        ConfigError: fp16 whose optimizer does not keep its scale on the device (the skip must be agreed over
            the stages without a host read: DeepSpeed's ZeRO optimizer as :mod:`domino.optim.zero_step` runs it,
            or :class:`domino.optim.mixed_precision.MixedPrecisionAdamW`).
    """
    if not config.train.fp16:
        return None
    scale = optimizer.device_loss_scale()
    if scale is None:
        raise ConfigError("--fp16 with --pipeline-model-parallel-size > 1 needs an optimizer that keeps its loss "
                          "scale on the device (domino.optim.zero_step at ZeRO 1, domino.optim.mixed_precision at "
                          f"ZeRO 0); got {type(optimizer.inner).__name__}")
    return scale


class PipelineStep:
    """Runs a pipelined run's optimizer steps.

    Args:
        config: the run's configuration.
        mesh: the run's parallel layout (this rank's pipeline, data-parallel and embedding groups).
        optimizer: the optimizer of this rank's stage.
        get_batch: ``get_batch(data_iterator) -> {tokens, labels, loss_mask, attention_mask, position_ids}`` for one
            micro-batch (:meth:`domino.train.gpt_recipe.GPTRecipe.batch`).
    """

    def __init__(self, config: DominoConfig, mesh: ParallelMesh, optimizer: TrainingOptimizer,
                 get_batch: Optional[Callable[..., Dict[str, torch.Tensor]]], micro_batches: int) -> None:
        if get_batch is None:
            raise ConfigError("--pipeline-model-parallel-size > 1 needs pretrain(get_batch=...): the pipeline "
                              "schedule, not forward_step, runs the stages")
        self.config, self.mesh, self.optimizer, self.get_batch = config, mesh, optimizer, get_batch
        self.module = optimizer.module
        self.micro_batches = micro_batches
        #: Each parameter's fp32 main gradient (bf16: DeepSpeed's BF16_Optimizer buffers; bf16 and fp16 at ZeRO 0:
        #: domino.optim.mixed_precision's), else None.
        self.main_grads = optimizer.main_gradients()
        #: fp16: the optimizer's dynamic loss scale, a 0-d device tensor updated in place each step, else None.
        self.loss_scale = fp16_loss_scale(config, optimizer)
        #: The optimizer's own gradient buckets (ZeRO 0 fp32: domino.optim.grad_buffer), whose DP mean the backward
        #: launches, as in a run without stages; else None.
        self.buckets = optimizer.gradient_buckets()
        #: --overlap-grad-reduce for DeepSpeed's optimizers: the buckets whose DP mean the backward launches
        #: (domino.pipeline.grad_overlap).
        self.overlap = (OverlappedGradReduce(list(self.module.parameters()), mesh.dp,
                                             exclude=tied_embedding_weight(self.module, mesh),
                                             main_grad=self.main_grads.__getitem__ if self.main_grads else None,
                                             replicas=mesh.dp_cp)
                        if config.parallel.overlap_grad_reduce and self.buckets is None else None)
        self._schedules: Dict[int, StageSchedule] = {}
        self.schedule = self._schedule(micro_batches)
        chunks, indices = self.schedule.chunks, self.schedule.indices
        first, last = self.schedule.is_first, self.schedule.is_last
        #: Whether this stage reads batches; the fields it passes on (Megatron's get_batch on pipeline ranks).
        self.reads_batches = stage_reads_batches(config, first, last)
        self.fields = (({"tokens"} if first else set()) | ({"labels", "loss_mask"} if last else set())
                       | {"position_ids", "attention_mask"})
        logger.info("pipeline stage %d of %d: %s, virtual stages %s (layers %s)%s",
                    mesh.pp.rank, mesh.pp.size,
                    "1F1B" if len(chunks) == 1 else f"interleaved 1F1B over {self.schedule.num_virtual_stages} "
                    "virtual stages", ", ".join(map(str, indices)),
                    "; ".join(",".join(map(str, chunk.layers.indices)) for chunk in chunks),
                    "" if self.reads_batches else "; reads no batches")

    def _schedule(self, micro_batches: int) -> StageSchedule:
        """The (1F1B or interleaved) schedule of a step of ``micro_batches``, one per count a batch-size ramp reaches (a stage's
        buffers are sized for its schedule's micro-batch count)."""
        if micro_batches not in self._schedules:
            m, t = self.config.model, self.config.train
            self._schedules[micro_batches] = StageSchedule(
                self.module, self.mesh.pp, num_microbatches=micro_batches, micro_batch_size=t.micro_batch_size,
                seq_length=m.seq_length, hidden_size=m.hidden_size,
                sequence_parallel=self.config.parallel.sequence_parallel,
                dtype=next(self.module.parameters()).dtype,
                scale_grads=self.overlap is None and self.buckets is None)
        return self._schedules[micro_batches]

    def _step_batch(self, data_iterator, count: Optional[int] = None) -> Dict[str, Optional[torch.Tensor]]:
        """``count`` micro-batches (default: a step's), each tensor this stage uses concatenated along the batch
        (the schedule splits them again); all None on a stage that reads no batch (:func:`stage_reads_batches`)."""
        if not self.reads_batches:
            return dict.fromkeys(BATCH_FIELDS)
        micro = [self.get_batch(data_iterator) for _ in range(count or self.micro_batches)]
        return {name: None if micro[0][name] is None or name not in self.fields else
                torch.cat([mb[name] for mb in micro]) for name in micro[0]}

    def __call__(self, data_iterator, timers, micro_batches: int
                 ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """One step of ``micro_batches`` per data-parallel rank. Returns the mean loss over the step's micro-batches
        averaged over the replicas, the gradient norm (0-d tensors on the device), and the optimizer's 0/1 skip flag
        of a non-finite norm (the ZeRO optimizer's device flag at ZeRO 1/2; None where DeepSpeed decides on the
        host)."""
        timers.start("forward-backward")
        batch = self._step_batch(data_iterator, micro_batches)
        self._schedule(micro_batches).loss_scale = self.loss_scale
        if self.overlap is not None:
            self.overlap.begin(micro_batches)
        if self.buckets is not None:
            self.buckets.begin(micro_batches)
        loss = self._schedule(micro_batches).train_step(batch["tokens"], batch["labels"], batch["loss_mask"],
                                                        batch["position_ids"], batch["attention_mask"])
        timers.stop("forward-backward")
        timers.start("optimizer")
        module = self.module
        if self.main_grads is not None:
            return self._main_gradient_step(loss, micro_batches, timers)
        if self.overlap is not None or self.buckets is not None:
            (self.overlap or self.buckets).finish()  # every bucket's DP mean, launched from the backward, waited for
            sync_tied_embeddings(module, self.mesh)
            tied = tied_embedding_weight(module, self.mesh)
            average_over_data_parallel([tied.grad] if tied is not None else [], self.mesh)
        else:
            sync_tied_embeddings(module, self.mesh)
            average_over_data_parallel([p.grad for p in module.parameters() if p.grad is not None], self.mesh)
        grad_norm = clip_gradients(module.parameters(), self.mesh, self.config.train.clip_grad,
                                   loss_scale=self.loss_scale)
        skipped = self.optimizer.step_reduced(grad_norm)
        timers.stop("optimizer")
        return self._logged(loss), grad_norm, skipped

    def _logged(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as logged: the whole sequences' (the context-parallel shares summed), averaged over the
        data-parallel replicas."""
        return average_across_data_parallel_group(sum_over_context(loss, self.mesh.cp), self.mesh.dp)

    def _main_gradient_step(self, loss: torch.Tensor, micro_batches: int, timers
                            ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The optimizer part of a step on fp32 main gradients (bf16; fp16 at ZeRO 0): the schedule's backward
        left each micro-batch's gradient summed in them (the optimizer's hooks; the 16-bit ``.grad`` is freed, so
        torch's ``scale_grads`` found nothing to divide). Here they become the mean over the micro-batches, the
        tied copies' sum, the mean over the replicas, are clipped by the norm over every stage (fp16: still
        scaled, by the unscaled norm; NaN everywhere when that norm is not finite, so every stage skips) and the
        optimizer's ``step_reduced`` (fp16: unscaling them) applies them."""
        buffers = self.optimizer.main_gradient_buffers()
        # Scaling the fp32 sums after the backward is DeepSpeed's unstaged division of the loss by the micro-batch
        # count moved past the backward: the same numbers wherever the count is a power of two.
        if self.overlap is not None or self.buckets is not None:
            # Every bucket's DP mean (the optimizer's own at ZeRO 0, already divided by the micro-batch count),
            # launched from the backward, waited for here.
            (self.overlap or self.buckets).finish()
            sync_tied_embeddings(self.module, self.mesh, self.main_grads)
            tied = tied_embedding_weight(self.module, self.mesh)
            average_over_data_parallel([self.main_grads[tied]] if tied is not None else [], self.mesh)
        else:
            torch._foreach_mul_(buffers, 1.0 / micro_batches)
            sync_tied_embeddings(self.module, self.mesh, self.main_grads)
            average_over_data_parallel(buffers, self.mesh)
        grad_norm = clip_gradients(self.module.parameters(), self.mesh, self.config.train.clip_grad,
                                   grad_of=self.main_grads.get, poison_overflow=True, loss_scale=self.loss_scale)
        skipped = self.optimizer.step_reduced(grad_norm)
        timers.stop("optimizer")
        return self._logged(loss), grad_norm, skipped

    @torch.no_grad()
    def evaluate(self, make_iterator: Callable, eval_iters: int) -> float:
        """The mean loss of ``eval_iters`` micro-batches of a fresh iterator, averaged over the replicas: the number
        :func:`domino.train.evaluation.evaluate` gives at one stage. Runs them a step's worth at a time (whatever is
        left in the last group)."""
        module = self.module
        was_training = module.training
        module.eval()
        iterator, total, done = make_iterator(), None, 0
        while done < eval_iters:
            count = min(self.micro_batches, eval_iters - done)
            batch = self._step_batch(iterator, count)
            loss = self.schedule.eval_step(batch["tokens"], batch["labels"], batch["loss_mask"],
                                           batch["position_ids"], batch["attention_mask"], count=count)
            loss = self._logged(loss).double() * count
            total = loss if total is None else total + loss  # summed on the device: one host read at the end
            done += count
        if was_training:
            module.train()
        return float(total) / eval_iters if total is not None else 0.0
