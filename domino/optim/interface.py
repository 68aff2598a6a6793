"""What the training loop, the pipeline step and the checkpoint manager know of the optimizer: one interface.

The step is decided on the device (the skip of a non-finite step, clipping and the fp16 loss scale are tensors,
read on the host only at log intervals); gradients accumulate over micro-batches; the state is stored by
parameter name (:mod:`domino.optim.state`). Which library does the work behind it (torch's AdamW at ZeRO 0, in
16 bits on fp32 masters; DeepSpeed's ZeRO and bf16 optimizers at ZeRO 1/2,
:class:`domino.optim.deepspeed_optimizer.DeepSpeedOptimizer`) is this package's business alone:
no module outside ``domino/optim/`` imports DeepSpeed (``tests/test_layering.py``).

A step, unpipelined::

    for last in optimizer.micro_batches(batch, samples_per_micro_batch):
        loss = loss_of(optimizer.forward_model(...))
        optimizer.backward(loss)
    outcome = optimizer.step()

Pipelined, the schedule runs the backward (:mod:`domino.train.pipeline_step`): the stage averages the gradients
(:meth:`TrainingOptimizer.gradients`) over the replicas, clips them with the norm over every stage, and
:meth:`TrainingOptimizer.step_reduced` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Protocol, Union

import torch
from torch import nn

from domino.optim.grad_buffer import GradBuckets


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step reports; tensors stay on the device until the loop logs them."""

    grad_norm: Optional[Union[torch.Tensor, float]]
    """The global gradient norm before clipping (a 0-d device tensor; a number where DeepSpeed's own optimizer
    computed it on the host), None where nothing computed it."""
    skipped: Optional[torch.Tensor]
    """The 0/1 device flag of a step skipped for non-finite gradients, None where the optimizer counts its skips
    on the host (:attr:`TrainingOptimizer.host_skipped_steps`)."""


class TrainingOptimizer(Protocol):
    """The optimizer of one rank's model (one pipeline stage's), with everything a step needs around it."""

    module: nn.Module
    """The model (this stage's) whose parameters it updates."""
    forward_model: nn.Module
    """What a micro-batch's forward calls: :attr:`module`, or a wrapper around it whose backward needs to have seen
    the forward (DeepSpeed's engine registers hooks on the outputs there)."""
    inner: object
    """The object holding the optimizer's state (for :mod:`domino.optim.state` only)."""

    def micro_batches(self, batch: int, samples_per_micro_batch: int) -> Iterator[bool]:
        """Sets up a step over a ``batch``-sample global batch; yields, per micro-batch, whether it is the last."""

    def backward(self, loss: torch.Tensor) -> None:
        """The backward of one micro-batch's loss (scaled for accumulation and fp16), gradients accumulated."""

    def step(self) -> StepOutcome:
        """After the last micro-batch's backward: reduces over the replicas, clips, steps (or skips) and zeroes."""

    def gradients(self) -> Dict[nn.Parameter, torch.Tensor]:
        """Where each parameter's accumulated gradient lives after a pipeline schedule's backward (the fp32 main
        gradient of a bf16 run, else ``.grad``); absent parameters got none."""

    def main_gradient_buffers(self) -> Optional[List[torch.Tensor]]:
        """The flat fp32 buffers the main gradients are views of (bf16 runs), else None."""

    def gradient_buckets(self) -> Optional[GradBuckets]:
        """The buckets whose data-parallel mean this optimizer launches from the backward (a pipeline stage's
        schedule arms them with ``begin(micro_batches)`` and waits with ``finish()``); None where the caller
        averages the gradients itself."""

    def device_loss_scale(self) -> Optional[torch.Tensor]:
        """fp16: the dynamic loss scale, a 0-d device tensor updated in place by each step; else None."""

    def step_reduced(self, grad_norm: torch.Tensor) -> Optional[torch.Tensor]:
        """Pipelined: steps with :meth:`gradients` already averaged over the replicas and clipped (``grad_norm``
        their norm over every stage); returns the 0/1 skip flag, None where skips are counted on the host."""

    def set_lr(self, lr: float) -> None:
        """The learning rate of the coming step, every parameter group."""

    def loss_scale(self) -> Optional[float]:
        """fp16: the current loss scale (a host read: log intervals only), else None."""

    @property
    def host_skipped_steps(self) -> int:
        """Steps skipped that the optimizer counted on the host (those without a device flag)."""

    def weights_loaded(self) -> None:
        """Called after the model's weights were loaded from a checkpoint: master copies refreshed from them."""

    def destroy(self) -> None:
        """Releases hooks and references (an in-process restart frees the process groups after it)."""
