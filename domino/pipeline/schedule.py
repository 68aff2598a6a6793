"""One rank's pipeline stage on ``torch.distributed.pipelining``'s 1F1B schedule, or its model chunks on the
interleaved 1F1B schedule (``ScheduleInterleaved1F1B``: one ``PipelineStage`` per chunk, virtual stage
``chunk * p + rank``; it runs the same per-micro-batch forwards, backwards and ``scale_grads`` as 1F1B, in Megatron's
depth-first interleaved order, and evaluation runs on ``ScheduleLoopedBFS``, which takes any micro-batch count).

What the library does for us (torch 2.13, ``torch/distributed/pipelining/schedules.py`` and ``stage.py``):
``Schedule1F1B.step`` splits the batch it is given along dimension 0 into ``n_microbatches`` equal micro-batches
(``tensor_split``), runs ``num_stages - stage`` warm-up forwards, then one backward per forward, sending
activations forward and their gradients back over the pipeline group with batched point-to-point ops
(``batch_isend_irecv``: gloo on CPU, NCCL on GPUs); the last stage applies ``loss_fn`` to each micro-batch's output,
backward runs ``torch.autograd.backward`` on the stage's outputs, and at the end every gradient of the stage
module is divided by the micro-batch count (``scale_grads=True``, ``perform_reduce_grad``), so a loss that is each
micro-batch's mean gives the gradient of the mean over the step, as DeepSpeed's gradient accumulation does.
It needs at least as many micro-batches as stages (``Schedule1F1B.__init__``); evaluation, forward only, runs on
``ScheduleGPipe``, which takes any number (each evaluation batch is one or more micro-batches, fewer than the
stages included), through its own ``PipelineStage`` (a stage's buffers are sized for its schedule's micro-batch
count). Shapes are given up front
(static metadata, ``PipelineStage(input_args=..., output_args=...)``): without them the library would run an
extra forward and backward on the first step only to learn them (``_forward_metadata_inference``).

Inputs: the first stage reads token ids; every stage reads the position ids (rotary positions, reset ones; built
here as ``0..s-1`` when not given) and the attention mask (None: causal), passed as keyword arguments split like
the batch; the last stage also reads the labels, and the loss mask is the schedule's ``target``. Between stages travels the residual stream
``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism, Megatron's choice too: the slice is what each rank has).
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
)

from domino.config.pipeline_schedule import microbatch_problems
from domino.pipeline.stages import model_chunks, virtual_stage
from domino.parallel.context_split import local_token_indices, masked_mean_loss
from domino.runtime.mesh import SINGLE, MeshGroup, collective_device


class StageSchedule:
    """Runs this rank's stage (a ``GPTModel`` cut by :func:`domino.pipeline.stages.split_model`, or the model
    chunks of a :class:`~domino.pipeline.stages.VirtualStages`) on the 1F1B schedule over the pipeline group, or
    on the interleaved 1F1B schedule with chunks.

    Args:
        model: the stage.
        pp: this rank's pipeline (``ParallelMesh.pp``), whose stages exchange activations.
        num_microbatches: micro-batches per optimizer step on this data-parallel rank (>= the stage count; with
            chunks, a multiple of it).
        micro_batch_size: samples per micro-batch.
        seq_length: tokens per sample.
        hidden_size: width of the residual stream.
        sequence_parallel: the residual stream is this rank's sequence slice.
        dtype: dtype of the residual stream (the model's parameters').
        scale_grads: torch divides every ``.grad`` by the micro-batch count after the backward; False where
            :mod:`domino.pipeline.grad_overlap` divides them itself (a reduction may be in flight then).

    Raises:
        ValueError: the micro-batch count is one the schedule cannot run (checked earlier by the config validation).
    """

    def __init__(self, model: nn.Module, pp: MeshGroup, *, num_microbatches: int, micro_batch_size: int,
                 seq_length: int, hidden_size: int, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, scale_grads: bool = True) -> None:
        stages, rank = pp.size, pp.rank
        self.pp = pp
        self.chunks: Sequence[nn.Module] = model_chunks(model)
        if num_microbatches < stages:
            raise ValueError(f"{num_microbatches} micro-batches per step are fewer than the {stages} pipeline stages "
                             "(1F1B needs one per stage)")
        problems = microbatch_problems(num_microbatches, stages, len(self.chunks))
        if problems:
            raise ValueError(problems[0])
        self.model = model
        self.num_microbatches = num_microbatches
        self.micro_batch_size = micro_batch_size
        self.num_virtual_stages = stages * len(self.chunks)
        self.indices = [virtual_stage(rank, c, stages) for c in range(len(self.chunks))]
        self.is_first, self.is_last = self.indices[0] == 0, self.indices[-1] == self.num_virtual_stages - 1
        tp = self.chunks[0].tp.size  # the stage's TP group: with SP each rank passes on its sequence slice
        self.cp = self.chunks[0].cp  # its context-parallel group: each rank holds seq / CP tokens of each sample
        tokens = seq_length // self.cp.size
        local_seq = tokens // tp if sequence_parallel and tp > 1 else tokens
        self._hidden = torch.empty(local_seq, micro_batch_size, hidden_size, dtype=dtype, device="meta",
                                   requires_grad=True)
        self._tokens = torch.empty(micro_batch_size, tokens, dtype=torch.long, device="meta")
        self._losses = torch.empty(micro_batch_size, tokens, dtype=torch.float32, device="meta")
        #: fp16: the dynamic loss scale (a 0-d device tensor, updated in place by the optimizer) that multiplies
        #: each micro-batch's loss before its backward; None: the loss as it is.
        self.loss_scale: Optional[torch.Tensor] = None
        #: The training schedule's ``PipelineStage`` per chunk.
        self.stages = self._new_stages()
        if len(self.stages) == 1:
            self.schedule = Schedule1F1B(self.stages[0], num_microbatches, loss_fn=self._scaled_loss,
                                         scale_grads=scale_grads)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, num_microbatches, loss_fn=self._scaled_loss,
                                                    scale_grads=scale_grads)
        self._eval_schedules: Dict[int, object] = {}

    def _scaled_loss(self, per_token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The training loss_fn: a micro-batch's :func:`masked_mean_loss`, times :attr:`loss_scale` under fp16 (the
        scaling DeepSpeed's ``engine.backward`` applies to the loss, ``loss_scaler.backward``, moved into the
        schedule, which runs the backward itself)."""
        loss = masked_mean_loss(per_token_losses, loss_mask, self.cp)
        return loss if self.loss_scale is None else loss * self.loss_scale

    @property
    def stage(self) -> PipelineStage:
        """The training schedule's ``PipelineStage`` (the first chunk's with several)."""
        return self.stages[0]

    def _new_stages(self) -> List[PipelineStage]:
        """One ``PipelineStage`` per chunk, with its shapes given up front."""
        group = self.pp.process_group
        device = collective_device(group)
        out = []
        for chunk, index in zip(self.chunks, self.indices):
            first, last = index == 0, index == self.num_virtual_stages - 1
            out.append(PipelineStage(chunk, index, self.num_virtual_stages, device, group=group,
                                     input_args=(self._tokens if first else self._hidden,),
                                     output_args=(self._losses if last else self._hidden,)))
        return out

    def _eval_schedule(self, count: int):
        """The forward-only schedule of ``count`` micro-batches (any number): GPipe for one chunk, torch's
        breadth-first looped schedule for chunks (every micro-batch through one chunk, then the next; neither
        checks the count against the stages, unlike 1F1B and interleaved 1F1B's rounds)."""
        if count not in self._eval_schedules:
            stages, loss = self._new_stages(), partial(masked_mean_loss, cp=self.cp)
            self._eval_schedules[count] = (ScheduleGPipe(stages[0], count, loss_fn=loss) if len(stages) == 1 else
                                           ScheduleLoopedBFS(stages, count, loss_fn=loss))
        return self._eval_schedules[count]

    def _arguments(self, tokens: Optional[torch.Tensor], labels: Optional[torch.Tensor],
                   position_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor], count: int):
        """The positional and keyword arguments of this rank's ``step`` over ``count`` micro-batches (each split
        into micro-batches; the keyword ones reach every chunk). A middle stage may pass None for the tokens and
        labels (it reads no batch)."""
        b, s = count * self.micro_batch_size, self._tokens.shape[1]
        if position_ids is None:  # this rank's tokens' positions (its chunks' under context parallelism)
            device = collective_device(self.pp.process_group)
            position_ids = local_token_indices(s * self.cp.size, self.cp, device).unsqueeze(0)
        kwargs: Dict[str, torch.Tensor] = {"position_ids": position_ids.expand(b, s)}  # split with the batch
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.expand(b, *attention_mask.shape[1:])
        if self.is_last:
            kwargs["labels"] = labels  # a chunk without the output layer ignores them
        args = (tokens,) if self.is_first else ()
        return args, kwargs

    def train_step(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   position_ids: Optional[torch.Tensor] = None,
                   attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward and backward over one step's micro-batches (``[num_microbatches * micro_batch_size, s]`` each;
        every stage passes the whole batch, each uses what it reads); leaves the gradients of the mean loss in the
        stage's ``.grad`` (not yet reduced over data-parallel ranks nor tied copies:
        :mod:`domino.pipeline.gradients`). Returns the mean loss over the micro-batches, a 0-d tensor, on every
        stage (broadcast from the last over the pipeline group)."""
        args, kwargs = self._arguments(tokens, labels, position_ids, attention_mask, self.num_microbatches)
        losses: List[torch.Tensor] = []
        if self.is_last:
            self.schedule.step(*args, target=loss_mask, losses=losses, return_outputs=False, **kwargs)
        else:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        return self._broadcast_mean(losses, scaled=True)

    def eval_step(self, tokens: Optional[torch.Tensor], labels: Optional[torch.Tensor],
                  loss_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                  attention_mask: Optional[torch.Tensor] = None, count: Optional[int] = None) -> torch.Tensor:
        """Forward only over ``count`` micro-batches (any number; default: those of ``tokens``, which a middle
        stage without a batch passes as None); returns their mean loss on every stage, as :meth:`train_step`
        does."""
        count = count or tokens.shape[0] // self.micro_batch_size
        schedule = self._eval_schedule(count)
        args, kwargs = self._arguments(tokens, labels, position_ids, attention_mask, count)
        losses: List[torch.Tensor] = []
        if self.is_last:
            schedule.eval(*args, target=loss_mask, losses=losses, **kwargs)
        else:
            schedule.eval(*args, **kwargs)
        return self._broadcast_mean(losses)

    def _broadcast_mean(self, losses: List[torch.Tensor], scaled: bool = False) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, on every stage of the pipeline (``scaled``: the training
        losses, divided by the fp16 loss scale again)."""
        group = self.pp.process_group
        device = collective_device(group)
        if self.is_last:
            mean = torch.stack([loss.detach().float() for loss in losses]).mean().reshape(1)
            if scaled and self.loss_scale is not None:
                mean = mean / self.loss_scale  # a power of two: the unscaled mean exactly
        else:
            mean = torch.zeros(1, device=device)
        dist.broadcast(mean, src=self.pp.ranks[-1], group=group)  # from the last stage's global rank
        return mean[0]
