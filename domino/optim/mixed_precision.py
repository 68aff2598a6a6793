"""ZeRO stage 0 with bf16 or fp16 weights: fp32 master weights and fp32 main gradients, torch's fused AdamW, no
DeepSpeed.

Megatron core's mixed-precision recipe (``optimizer/optimizer.py`` ``Float16OptimizerWithFloat16Params``, and
``distributed/param_and_grad_buffer.py`` for ``main_grad``), which is also what DeepSpeed 0.19.8's
``BF16_Optimizer`` computes at one partition (``runtime/bf16_optimizer.py``):

* the model's weights are cast to 16 bits (parameters only, buffers stay fp32: DeepSpeed's
  ``_cast_module_mixed_precision``, ``runtime/engine.py``), and each gets an fp32 master copy of the 16-bit value,
  a view into one flat fp32 buffer per parameter group;
* each micro-batch's 16-bit gradient is added into the parameter's fp32 ``main_grad`` by a post-accumulate-grad
  hook and freed; the buckets' fp32 sums over the replicas are launched from the backward and divided by the
  data-parallel size after the sum (:class:`~domino.optim.grad_buffer.GradBuckets`, DeepSpeed's
  ``allreduce_bucket`` arithmetic with ``communication_data_type`` fp32, as domino configures it);
* the main gradients are the masters' ``.grad``: the norm, clipping and the skip of a non-finite step are
  :mod:`domino.optim.clipping`'s, on the device, with the parameters taken in the optimizer's group order (the
  order of DeepSpeed's ``get_grads_for_norm``, so the sum of squares rounds alike); torch's fused AdamW steps the
  masters (its ``found_inf`` skips), and the masters are copied into the 16-bit weights;
* fp16: the loss is multiplied by a dynamic loss scale kept on the device (:class:`DeviceDynamicLossScaler`,
  DeepSpeed's ``DynamicLossScaler`` rule, :mod:`domino.optim.device_loss_scale`); the norm is the unscaled
  one and the gradients are multiplied by DeepSpeed ZeRO's ``1 / (max(1, (norm + 1e-6) / clip) * scale)``
  (``unscale_and_clip_grads``) with the scale they were computed with; an overflow skips the step and updates
  the scale, with no host read.

The checkpoint stores the masters as ``fp32.NAME`` and the scaler's fields by name (:mod:`domino.optim.state`
reads :attr:`MixedPrecisionAdamW.masters` and :attr:`MixedPrecisionAdamW.loss_scaler`), the layout DeepSpeed's
optimizers are stored in, so runs resume across this path and DeepSpeed's ZeRO 1/2 in either direction.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from domino.config import DominoConfig
from domino.optim import clipping, device_loss_scale
from domino.optim.deepspeed_config import deepspeed_config
from domino.optim.grad_buffer import GradBuckets, gradient
from domino.optim.interface import StepOutcome
from domino.optim.torch_optimizer import BucketedAdamW, adamw, broadcast_weights, optimizer_param_groups
from domino.pipeline.gradients import tied_embedding_weight
from domino.runtime.mesh import ParallelMesh

#: DeepSpeed's epsilon in the clip factor (``unscale_and_clip_grads``, ``clip_tensors_by_global_norm``).
CLIP_EPS = 1e-6


class DeviceDynamicLossScaler:
    """DeepSpeed 0.19.8's ``DynamicLossScaler`` (``runtime/fp16/loss_scaler.py``) without DeepSpeed: its fields
    by the same names (a checkpoint's ``loss_scaler`` object is read and written by name either way), the scale,
    the hysteresis and the last overflow's iteration as 0-d device tensors (:mod:`domino.optim.device_loss_scale`).
    """

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, delayed_shift: int,
                 device: torch.device, consecutive_hysteresis: bool = False) -> None:
        self.cur_scale = float(init_scale)
        self.dynamic = True
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = True
        device_loss_scale.fields_to_device(self, device)

    update_scale = torch.no_grad()(device_loss_scale.update_scale)
    __setattr__ = device_loss_scale.set_field


def dynamic_loss_scaler(config: DominoConfig, mesh: ParallelMesh, device: torch.device) -> DeviceDynamicLossScaler:
    """fp16's scaler with the settings DeepSpeed's would get (:func:`domino.optim.deepspeed_config.deepspeed_config`,
    ``--deepspeed-config`` overrides included; DeepSpeed's defaults for what it leaves out)."""
    fp16 = deepspeed_config(config, mesh.dp.size)["fp16"]
    return DeviceDynamicLossScaler(2.0 ** fp16.get("initial_scale_power", 16), fp16.get("loss_scale_window", 1000),
                                   fp16.get("min_loss_scale", 1), fp16.get("hysteresis", 2), device,
                                   consecutive_hysteresis=fp16.get("consecutive_hysteresis", False))


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's floating parameters in ``dtype``, its buffers as they are (DeepSpeed's cast)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


class MixedPrecisionAdamW(BucketedAdamW):
    """torch's fused AdamW on fp32 masters of a bf16/fp16 model (module docstring).

    Args:
        model: this rank's model (its stage's), on its device, fp32 or already 16-bit; cast to the run's dtype.
        config: the run's configuration (``--bf16`` or ``--fp16``).
        mesh: the run's parallel layout.
        pipelined: a pipeline stage's: its schedule runs the backward (:meth:`gradient_buckets`, :meth:`step_reduced`).
    """

    def __init__(self, model: nn.Module, config: DominoConfig, mesh: ParallelMesh, pipelined: bool = False) -> None:
        t = config.train
        self.module = self.forward_model = model
        self.config, self.mesh, self.fp16 = config, mesh, bool(t.fp16)
        cast_parameters(model, torch.float16 if t.fp16 else torch.bfloat16)
        broadcast_weights(model, mesh)
        groups = optimizer_param_groups(model, t.weight_decay)
        #: The 16-bit parameters in the optimizer's group order (the norm's summation order).
        self.params: List[nn.Parameter] = [p for g in groups for p in g["params"]]
        #: Each 16-bit parameter's fp32 master, a view into its group's flat buffer.
        self.masters: Dict[nn.Parameter, torch.Tensor] = {}
        for group in groups:
            flat = torch.cat([p.detach().reshape(-1).float() for p in group["params"]])
            offset, views = 0, []
            for param in group["params"]:
                views.append(flat[offset:offset + param.numel()].view_as(param))
                self.masters[param] = views[-1]
                offset += param.numel()
            group["params"] = views
        self.inner = adamw(model, config, groups)
        if not self.inner.defaults.get("fused"):
            raise ValueError("fp32 master weights without DeepSpeed need torch's fused AdamW (its found_inf skips a "
                             "step on the device): CUDA, or CPU from torch 2.4")
        self.grads = GradBuckets(list(model.parameters()), mesh.dp, mesh.dp_cp,
                                 exclude=tied_embedding_weight(model, mesh) if pipelined else None,
                                 divide_by_micro_batches=pipelined)
        for param, master in self.masters.items():
            master.grad = param.main_grad  # fixed views: the fp32 sums are the masters' gradients
        self._lp, self._hp = list(self.masters), list(self.masters.values())
        #: fp16: the dynamic loss scaler, else None.
        self.loss_scaler = dynamic_loss_scaler(config, mesh, self.params[0].device) if self.fp16 else None
        self._micro_batches = 1

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's order: the loss divided by the accumulation steps, then (fp16) times the loss scale."""
        loss = loss / self._micro_batches
        if self.fp16:
            loss = loss * self.loss_scaler.cur_scale
        loss.backward()

    def step(self) -> StepOutcome:
        self.grads.finish()  # the buckets launched during the backward, waited for
        clip = self.config.train.clip_grad
        if not self.fp16:
            norm = clipping.clip_gradients(self.params, self.mesh, clip, grad_of=gradient)
            return StepOutcome(norm, self._apply(norm))
        scale = self.loss_scaler.cur_scale  # the scale these gradients carry (_apply updates it after their use)
        norm = clipping.clip_gradients(self.params, self.mesh, 0.0, grad_of=gradient, loss_scale=scale)
        combined = torch.clamp((norm + CLIP_EPS) / clip, min=1.0) * scale if clip > 0 else scale
        torch._foreach_mul_(self._main_grads(), 1.0 / combined)
        return StepOutcome(norm, self._apply(norm))

    def _main_grads(self) -> List[torch.Tensor]:
        return [gradient(p) for p in self._lp]

    def _apply(self, norm: torch.Tensor) -> torch.Tensor:
        """Steps the masters (skipped on the device when ``norm`` is not finite), updates fp16's scale, copies the
        masters into the 16-bit weights and zeroes the gradients; returns the 0/1 skip flag."""
        skipped = clipping.flag_overflow(self.inner, norm)
        self.inner.step()
        if self.fp16:
            self.loss_scaler.update_scale(skipped.bool())
        with torch.no_grad():
            torch._foreach_copy_(self._lp, self._hp)  # rounded to 16 bits (unchanged masters on a skip)
        self.grads.zero()
        return skipped

    def main_gradients(self) -> Dict[nn.Parameter, torch.Tensor]:
        """Each 16-bit parameter's fp32 main gradient (a pipeline stage's tied embedding's included)."""
        return {p: gradient(p) for p in self.module.parameters() if gradient(p) is not None}

    def main_gradient_buffers(self) -> List[torch.Tensor]:
        return self.grads.buffers + [gradient(p) for p in self.grads.excluded if gradient(p) is not None]

    def device_loss_scale(self) -> Optional[torch.Tensor]:
        return self.loss_scaler.cur_scale if self.fp16 else None

    def step_reduced(self, grad_norm: torch.Tensor) -> Optional[torch.Tensor]:
        """Pipelined: the main gradients are averaged and clipped (fp16: still scaled, clipped by the unscaled
        ``grad_norm``); fp16 divides them by the scale here."""
        if self.fp16:
            torch._foreach_mul_(self._main_grads(), 1.0 / self.loss_scaler.cur_scale)
        return self._apply(grad_norm)

    def loss_scale(self) -> Optional[float]:
        return float(self.loss_scaler.cur_scale) if self.fp16 else None  # a host read: log intervals only

    def weights_loaded(self) -> None:
        """The masters widened from the loaded 16-bit weights (the checkpoint's ``fp32.NAME`` then overwrites them
        where the optimizer state is resumed)."""
        with torch.no_grad():
            torch._foreach_copy_(self._hp, self._lp)
