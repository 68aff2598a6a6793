"""domino's subclasses of DeepSpeed's optimizer wrappers and loss scaler, made at construction (no class swapped).

DeepSpeed 0.19.8 offers no hook to change how its ``BF16_Optimizer`` and ``DeepSpeedZeroOptimizer`` step or how
its ``DynamicLossScaler`` updates (``bf16`` takes ``enabled``, ``immediate_grad_update`` and
``check_grad_overflow``; ``fp16`` the scale's parameters only), so domino subclasses each once; the engine
builds the two optimizers (:class:`domino.optim.deepspeed_engine.DominoDeepSpeedEngine`) and the ZeRO optimizer
builds its scaler. The methods themselves are written, with the DeepSpeed source they follow, in
:mod:`domino.optim.bf16_step`, :mod:`domino.optim.zero_step` and :mod:`domino.optim.device_loss_scale`.

This module imports DeepSpeed: it is imported only once DeepSpeed may be (``deepspeed_runtime.prepare`` chose its
accelerator), by :func:`domino.optim.deepspeed_optimizer.build_deepspeed_optimizer` and the objects it built.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from domino.optim import bf16_step, device_loss_scale, zero_step


def _refuse_inexact(optimizer, problem) -> None:
    """Raises where the engine built ``optimizer`` although its device-decided step is not exact (``problem``):
    the engine's check before construction and the object's disagree, as after a DeepSpeed change."""
    if problem:
        raise RuntimeError(f"{type(optimizer).__name__} built where its step is not exact: {problem}")


class DeviceLossScaler(DynamicLossScaler):
    """DeepSpeed's ``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``, 0.19.8) with the scale, the
    hysteresis and the last overflow's iteration as 0-d tensors on ``device``, updated there
    (:mod:`domino.optim.device_loss_scale`).

    Args:
        init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis, raise_error_at_min_scale,
            dtype: ``DynamicLossScaler``'s own parameters.
        device: where the three fields live.
    """

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                 raise_error_at_min_scale=True, dtype=torch.half, device=None) -> None:
        super().__init__(init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                         raise_error_at_min_scale=raise_error_at_min_scale, dtype=dtype)
        device_loss_scale.fields_to_device(self, device)

    update_scale = torch.no_grad()(device_loss_scale.update_scale)
    __setattr__ = device_loss_scale.set_field

    @classmethod
    def like(cls, scaler: DynamicLossScaler, device) -> "DeviceLossScaler":
        """A new device scaler with ``scaler``'s parameters and every one of its current values."""
        new = cls(scaler.cur_scale, scaler.scale_window, scaler.min_scale, scaler.delayed_shift,
                  scaler.consecutive_hysteresis, raise_error_at_min_scale=scaler.raise_error_at_min_scale,
                  dtype=scaler.dtype, device=device)
        for name, value in vars(scaler).items():
            setattr(new, name, value)  # a number for a device field is copied into its tensor
        return new


class DeviceDecidedBF16Optimizer(BF16_Optimizer):
    """DeepSpeed's ``BF16_Optimizer`` (``deepspeed/runtime/bf16_optimizer.py``, 0.19.8) whose step decides
    overflow and clipping on the device (:mod:`domino.optim.bf16_step`). Built by the engine with the arguments
    DeepSpeed's ``_configure_bf16_optimizer`` passes, where :func:`domino.optim.bf16_step.unsupported` finds
    nothing against it (checked again on the built object).
    """

    #: The 0/1 device flag of the last step's skip.
    found_inf = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _refuse_inexact(self, bf16_step.unsupported(self))

    step = torch.no_grad()(bf16_step._device_decided_step)


class DeviceDecidedZeroOptimizer(DeepSpeedZeroOptimizer):
    """DeepSpeed's ZeRO 1/2 optimizer (``deepspeed/runtime/zero/stage_1_and_2.py``, 0.19.8) whose step decides
    overflow, loss scale and clipping on the device and whose reductions over a one-rank group skip the
    collective (:mod:`domino.optim.zero_step`). Built by the engine with the arguments DeepSpeed's
    ``_configure_zero_optimizer`` passes, where :func:`domino.optim.zero_step.unsupported` finds nothing against
    it (checked again on the built object); fp16's dynamic scaler is then replaced by a :class:`DeviceLossScaler`
    with its values (the ``self.loss_scaler`` DeepSpeed's ``__init__`` made from ``CreateLossScaler``: nothing
    else holds it).
    """

    #: The 0/1 device flag of the last step's skip.
    found_inf = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _refuse_inexact(self, zero_step.unsupported(self))
        if type(self.loss_scaler) is DynamicLossScaler:
            self.loss_scaler = DeviceLossScaler.like(self.loss_scaler,
                                                     self.single_partition_of_fp32_groups[0].device)

    step = torch.no_grad()(zero_step._device_decided_step)
    _unscale_and_clip = zero_step._unscale_and_clip
    get_grad_norm_direct = zero_step._grad_norm_direct
    allreduce_bucket = zero_step._allreduce_bucket
    gradient_reduction_w_predivide = zero_step._gradient_reduction_w_predivide
    _muon_update_lacks_loss_scale = zero_step._muon_update_lacks_loss_scale
