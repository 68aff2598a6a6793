"""DeepSpeed behind :class:`~domino.optim.interface.TrainingOptimizer` at ZeRO 1/2: the engine, its ZeRO and
bf16 optimizers, and domino's device-decided steps for them, seen from outside as one optimizer.

DeepSpeed 0.19.8 (the release line ``pyproject.toml`` admits, :mod:`domino.optim.deepspeed_runtime`) builds, from
the config :func:`domino.optim.deepspeed_config.deepspeed_config` derives: ``BF16_Optimizer`` for bf16 at ZeRO 1
(:mod:`domino.optim.bf16_step`) and ``DeepSpeedZeroOptimizer`` otherwise (:mod:`domino.optim.zero_step`), both
as domino's subclasses, which its engine subclass builds (:mod:`domino.optim.deepspeed_engine`). Runs at ZeRO 0,
in every precision, take no DeepSpeed (:mod:`domino.optim.build`: torch's AdamW, on fp32 masters in bf16/fp16,
:mod:`domino.optim.mixed_precision`); tests still build this module at ZeRO 0 as a reference, where DeepSpeed
takes torch's AdamW alone in fp32 and its ``FP16_Optimizer`` in fp16. Only this module drives the engine.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

from domino.config import DominoConfig
from domino.optim import bf16_step, deepspeed_runtime, zero_step
from domino.optim.clipping import clip_gradients, flag_overflow, skip_non_finite
from domino.optim.deepspeed_config import clips_itself, deepspeed_config, zero_stage
from domino.optim.deepspeed_mpu import DeepSpeedMpu
from domino.optim.interface import StepOutcome
from domino.optim.torch_optimizer import adamw
from domino.runtime.mesh import ParallelMesh, collective_device


class DeepSpeedOptimizer:
    """A DeepSpeed engine seen as a :class:`~domino.optim.interface.TrainingOptimizer` (build it with
    :func:`build_optimizer`).

    Args:
        engine: DeepSpeed's engine around ``module`` (reached by this class and its tests only).
        config: the run's configuration.
        mesh: the run's parallel layout.
    """

    def __init__(self, engine, config: DominoConfig, mesh: ParallelMesh) -> None:
        self.engine, self.config, self.mesh = engine, config, mesh
        self.module: nn.Module = engine.module
        # The engine's forward, not the module's: it registers the hooks on the outputs that run its backward
        # prologue (deepspeed 0.19.8 runtime/engine.py ``forward`` -> ``register_output_backward_hooks``), and
        # clears the ZeRO optimizer's backward-seen flag; a loss from the bare module is accumulated otherwise.
        self.forward_model = engine
        self._clips = clips_itself(config, mesh.dp.size)
        self._last = True
        #: bf16 with BF16_Optimizer: each parameter's fp32 main gradient (a view into its flat buffers).
        self._main_grads = (bf16_step.main_gradients(engine.optimizer)
                            if bf16_step.is_bf16_optimizer(engine.optimizer) else None)

    @property
    def inner(self):
        """DeepSpeed's optimizer wrapper (ZeRO's, BF16_Optimizer, FP16_Optimizer) or torch's AdamW at ZeRO 0."""
        return self.engine.optimizer

    def micro_batches(self, batch: int, samples_per_micro_batch: int) -> Iterator[bool]:
        """Sets the engine up for a step over a ``batch``-sample global batch and yields, for each of its
        micro-batches (``batch // samples_per_micro_batch``, DP ranks together), whether it ends the step.

        DeepSpeed 0.19.8 (``runtime/engine.py``) divides each micro-batch's loss by the engine's accumulation
        steps, which ``set_train_batch_size`` sets; its own boundary test, ``(micro_steps + 1) % gas == 0`` over
        the run's micro-step count, goes wrong once the batch grows, so the boundary is set before each
        micro-batch (``set_gradient_accumulation_boundary``).
        """
        steps = batch // samples_per_micro_batch
        self.engine.set_train_batch_size(batch)
        for micro in range(steps):
            self._last = micro == steps - 1
            self.engine.set_gradient_accumulation_boundary(self._last)
            yield self._last

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's backward (the loss divided by the accumulation steps, fp16's scale, ZeRO's reduction hooks)."""
        self.engine.backward(loss)
        if not self._last:
            self.engine.step()  # counts the micro-batch: DeepSpeed steps the optimizer at the boundary only

    def step(self) -> StepOutcome:
        """Clips (where domino does, :func:`~domino.optim.deepspeed_config.clips_itself`) and steps."""
        grad_norm = skipped = None
        if self._clips:
            grad_norm = clip_gradients(self.module.parameters(), self.mesh, self.config.train.clip_grad)
            skipped = skip_non_finite(self.inner, self.module, grad_norm)
        self.engine.step()
        if skipped is None:
            skipped = self._device_skip_flag()
        if grad_norm is None:  # DeepSpeed's wrapper computed it: a device tensor for domino's device-decided steps
            grad_norm = self.engine.get_global_grad_norm()
        return StepOutcome(grad_norm, skipped)

    def _device_skip_flag(self) -> Optional[torch.Tensor]:
        flag = bf16_step.skip_flag(self.engine)
        return flag if flag is not None else zero_step.skip_flag(self.engine)

    def main_gradients(self) -> Optional[Dict[nn.Parameter, torch.Tensor]]:
        """bf16 (BF16_Optimizer): each parameter's fp32 main gradient; else None (gradients are in ``.grad``)."""
        return self._main_grads

    def main_gradient_buffers(self) -> Optional[List[torch.Tensor]]:
        return bf16_step.main_gradient_buffers(self.inner) if self._main_grads is not None else None

    def gradient_buckets(self) -> None:
        return None  # DeepSpeed's optimizers reduce in their own step; a pipeline stage averages before it

    def device_loss_scale(self) -> Optional[torch.Tensor]:
        """fp16: the ZeRO optimizer's loss scale when it lives on the device (:mod:`domino.optim.zero_step`)."""
        if not self.config.train.fp16:
            return None
        scale = getattr(getattr(self.inner, "loss_scaler", None), "cur_scale", None)
        return scale if isinstance(scale, torch.Tensor) else None

    def step_reduced(self, grad_norm: torch.Tensor) -> Optional[torch.Tensor]:
        """Pipelined: the gradients are averaged over the replicas and clipped; DeepSpeed's wrapper takes them
        (ZeRO 1: each rank its partition's slice, :func:`domino.optim.zero_step.take_reduced_gradients`)."""
        if self._main_grads is not None:
            for flags in self.inner.fp32_groups_has_gradients:  # the norm and step of DeepSpeed read every buffer
                flags[:] = [True] * len(flags)
            self.engine.step()
            return self._device_skip_flag()
        skipped = None
        if zero_stage(self.config, self.mesh.dp.size) == 0:
            skipped = flag_overflow(self.inner, grad_norm)  # fused AdamW skips on the device
        else:
            # ZeRO 1 takes its partition of the (already averaged, equal) gradients without reducing them again.
            zero_step.take_reduced_gradients(self.inner)
        self.engine.step()
        return skipped if skipped is not None else self._device_skip_flag()

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def loss_scale(self) -> Optional[float]:
        scaler = getattr(self.inner, "loss_scaler", None)
        return float(scaler.cur_scale) if scaler is not None and self.config.train.fp16 else None

    @property
    def host_skipped_steps(self) -> int:
        """DeepSpeed's own count (its wrappers that read the overflow on the host)."""
        return int(self.engine.skipped_steps)

    def weights_loaded(self) -> None:
        if hasattr(self.inner, "refresh_fp32_params"):
            self.inner.refresh_fp32_params()  # ZeRO keeps its own fp32 master copy of the weights

    def destroy(self) -> None:
        """DeepSpeed's ``engine.destroy()`` (its ZeRO optimizer's gradient hooks removed: deepspeed 0.19.8
        runtime/engine.py ``destroy`` -> zero/stage_1_and_2.py ``destroy``)."""
        self.engine.destroy()


def build_deepspeed_optimizer(model: torch.nn.Module, config: DominoConfig, mesh: ParallelMesh) -> DeepSpeedOptimizer:
    """Wraps ``model`` in a DeepSpeed engine with torch AdamW, over ``mesh`` (DeepSpeed's ``mpu``:
    :class:`~domino.optim.deepspeed_mpu.DeepSpeedMpu`).

    The model is moved to its device first, so the optimizer is built over device parameters (fused AdamW
    refuses CPU parameters on torch < 2.4). torch's AdamW (:func:`~domino.optim.torch_optimizer.adamw`) rather
    than DeepSpeed's fused Adam, so CPU runs need no JIT build.
    """
    # DeepSpeed imported with its accelerator chosen (it picks it at import), its comm layer over our groups.
    deepspeed_runtime.prepare()
    deepspeed_runtime.start_comm()
    from domino.optim import deepspeed_engine

    model.to(collective_device(mesh.tp.process_group))
    optimizer = adamw(model, config)
    # Overflow, loss scale and clipping decided on the device: bf16 ZeRO 1 (BF16_Optimizer), fp16/fp32 ZeRO 1/2 and
    # bf16 ZeRO 2 (DeepSpeedZeroOptimizer, which also skips its collectives over a one-rank DP group), subclasses
    # the engine builds in their place (domino.optim.deepspeed_engine).
    engine = deepspeed_engine.initialize(model=model, optimizer=optimizer,
                                         config=deepspeed_config(config, mesh.dp.size), mpu=DeepSpeedMpu(mesh))
    if mesh.dp_cp.size == 1 and (zero_stage(config, 1) == 0 or bf16_step.is_bf16_optimizer(engine.optimizer)):
        # DeepSpeed 0.19.8 (runtime/engine.py, `_backward_epilogue` -> `allreduce_gradients` ->
        # `buffered_allreduce_fallback` -> `allreduce_and_copy`) flattens every gradient into one buffer,
        # all-reduces it over the data-parallel group and copies it back, even when that group is this process
        # alone (the mean over one replica is the identity). `enable_backward_allreduce` is the engine's own
        # switch for it (its PipelineEngine turns it off, runtime/pipe/engine.py); ZeRO optimizers reduce through
        # the same call to move gradients into their partitions, hence stage 0 only, and the BF16_Optimizer of
        # bf16 ZeRO 1, which reduces its fp32 gradient buffers through that call and nothing else
        # (`buffered_allreduce_fallback` -> `BF16_Optimizer.get_grads_for_reduction`; it has no
        # `reduce_gradients`).
        engine.enable_backward_allreduce = False
    return DeepSpeedOptimizer(engine, config, mesh)
