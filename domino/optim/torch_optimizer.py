"""ZeRO stage 0 in fp32: torch's fused AdamW behind :class:`~domino.optim.interface.TrainingOptimizer`, no DeepSpeed.

With every replica holding the whole optimizer state there is nothing for DeepSpeed to shard: its engine only
divided the loss by the accumulation steps, all-reduced the gradients after the backward and stepped torch's AdamW
(deepspeed 0.19.8 ``runtime/engine.py``: ``_scale_loss_by_gas``, ``allreduce_gradients`` ->
``buffered_allreduce_fallback``). Here the same arithmetic with the gradients in contiguous buckets whose
data-parallel mean is launched from the backward (:class:`~domino.optim.grad_buffer.GradBuckets`), overlapped
with it instead of after it; the clipping and the skip of a non-finite step are domino's, on the device
(:mod:`domino.optim.clipping`). Checkpoints store the state by name as before (:mod:`domino.optim.state` reads a
torch optimizer directly), so runs resume across this change and across ZeRO stages.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from domino.config import DominoConfig
from domino.optim import clipping
from domino.optim.grad_buffer import GradBuckets
from domino.optim.interface import StepOutcome
from domino.pipeline.gradients import tied_embedding_weight
from domino.runtime.mesh import ParallelMesh, collective_device


def optimizer_param_groups(model: nn.Module, weight_decay: float) -> List[dict]:
    """Two AdamW groups: weights with decay; biases and LayerNorm parameters (all 1-D) without."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw(model: nn.Module, config: DominoConfig, groups: Optional[List[dict]] = None) -> torch.optim.AdamW:
    """torch's AdamW over ``model``'s parameters (already on their device; or over ``groups``, those of
    :func:`optimizer_param_groups` with other tensors, fp32 masters) with the run's settings: its fused
    kernel wherever torch has one (:func:`~domino.optim.clipping.fused_optimizer_supported`), which also lets a
    non-finite step be skipped on the device (:func:`~domino.optim.clipping.flag_overflow`)."""
    t = config.train
    fused = clipping.fused_optimizer_supported(next(model.parameters()).device)
    return torch.optim.AdamW(groups or optimizer_param_groups(model, t.weight_decay), lr=t.lr,
                             betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, fused=fused or None,
                             foreach=None if fused else True)


def uses_torch_optimizer(zero_stage: int) -> bool:
    """Whether the run's step is torch's AdamW without DeepSpeed: ZeRO stage 0, :class:`TorchAdamW` in fp32,
    :class:`~domino.optim.mixed_precision.MixedPrecisionAdamW` (fp32 masters and main gradients) in bf16/fp16."""
    return zero_stage == 0


def broadcast_weights(model: nn.Module, mesh: ParallelMesh) -> None:
    """Every replica starts from the first one's weights, as DeepSpeed's engine makes sure at construction
    (``_broadcast_model``, deepspeed 0.19.8 runtime/engine.py); the seeds already agree, this is the guard."""
    group = mesh.dp_cp
    if group.size == 1:
        return
    for param in model.parameters():  # synchronous: once, before any step
        dist.broadcast(param.data, src=group.first_rank, group=group.process_group)


class BucketedAdamW:
    """What domino's own optimizers share: the gradients in :class:`~domino.optim.grad_buffer.GradBuckets`
    (``self.grads``), torch's AdamW as ``self.inner``, every skip decided on the device. Subclasses set
    ``self.grads``, ``self.inner`` and ``self._micro_batches`` in their constructor."""

    grads: GradBuckets
    inner: torch.optim.Optimizer
    _micro_batches: int

    def micro_batches(self, batch: int, samples_per_micro_batch: int) -> Iterator[bool]:
        self._micro_batches = batch // samples_per_micro_batch
        self.grads.begin(self._micro_batches)
        for micro in range(self._micro_batches):
            yield micro == self._micro_batches - 1

    def gradient_buckets(self) -> Optional[GradBuckets]:
        """The buckets whose reduction the backward launches (None at one replica: nothing to reduce)."""
        return self.grads if self.grads.reduces else None

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    @property
    def host_skipped_steps(self) -> int:
        return 0  # every skip has its device flag

    def destroy(self) -> None:
        self.grads.remove()


class TorchAdamW(BucketedAdamW):
    """torch's AdamW, its gradients in :class:`~domino.optim.grad_buffer.GradBuckets`.

    Args:
        model: this rank's model (its stage's), fp32, on its device.
        config: the run's configuration.
        mesh: the run's parallel layout.
        pipelined: a pipeline stage's: its schedule runs the backward (:meth:`gradient_buckets`, :meth:`step_reduced`).
    """

    def __init__(self, model: nn.Module, config: DominoConfig, mesh: ParallelMesh, pipelined: bool = False) -> None:
        self.module = self.forward_model = model
        self.config, self.mesh = config, mesh
        broadcast_weights(model, mesh)
        self.inner = adamw(model, config)
        self.grads = GradBuckets(list(model.parameters()), mesh.dp, mesh.dp_cp,
                                 exclude=tied_embedding_weight(model, mesh) if pipelined else None,
                                 divide_by_micro_batches=pipelined)
        self._micro_batches = 1

    def backward(self, loss: torch.Tensor) -> None:
        """The loss divided by the accumulation steps (DeepSpeed's ``_scale_loss_by_gas``), then its backward."""
        (loss / self._micro_batches).backward()

    def step(self) -> StepOutcome:
        self.grads.finish()  # the buckets launched during the backward, waited for
        grad_norm = clipping.clip_gradients(self.module.parameters(), self.mesh, self.config.train.clip_grad)
        skipped = clipping.skip_non_finite(self.inner, self.module, grad_norm)
        self.inner.step()
        self.grads.zero()
        return StepOutcome(grad_norm, skipped)

    def main_gradients(self) -> Optional[Dict[nn.Parameter, torch.Tensor]]:
        return None  # the gradients are the parameters' .grad (views into the buckets)

    def main_gradient_buffers(self) -> Optional[List[torch.Tensor]]:
        return None

    def device_loss_scale(self) -> Optional[torch.Tensor]:
        return None

    def step_reduced(self, grad_norm: torch.Tensor) -> Optional[torch.Tensor]:
        skipped = clipping.skip_non_finite(self.inner, self.module, grad_norm)
        self.inner.step()
        self.grads.zero()
        return skipped

    def loss_scale(self) -> Optional[float]:
        return None

    def weights_loaded(self) -> None:
        pass  # the parameters are the master weights


def build_torch_optimizer(model: nn.Module, config: DominoConfig, mesh: ParallelMesh):
    """:class:`TorchAdamW` over ``model`` (fp32), or :class:`~domino.optim.mixed_precision.MixedPrecisionAdamW`
    (``--bf16``/``--fp16``), the model moved to its device first (fused AdamW refuses CPU parameters on
    torch < 2.4)."""
    model.to(collective_device(mesh.tp.process_group))
    pipelined = config.parallel.pipeline_model_parallel_size > 1
    if config.train.bf16 or config.train.fp16:
        from domino.optim.mixed_precision import MixedPrecisionAdamW

        return MixedPrecisionAdamW(model, config, mesh, pipelined=pipelined)
    return TorchAdamW(model, config, mesh, pipelined=pipelined)
