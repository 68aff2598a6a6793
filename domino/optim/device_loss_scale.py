"""fp16 dynamic loss scaling with the scale's update decided on the device (no host read per step).

DeepSpeed 0.19.8's ``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``) keeps the scale, the
hysteresis and the iteration of the last overflow as Python numbers, so its ``update_scale(overflow)`` needs the
overflow as a Python ``bool``: every fp16 optimizer of DeepSpeed reads it on the host each step (the ZeRO
optimizer's ``has_overflow``, ``deepspeed/runtime/zero/stage_1_and_2.py``: ``overflow_gpu[0].item()``; the fp16
optimizers' ``CheckOverflow.check``, ``deepspeed/runtime/utils.py``).
:class:`~domino.optim.deepspeed_subclasses.DeviceLossScaler` is the same scaler with those three numbers as 0-d
tensors on the device and the same rule written as ``torch.where`` (:func:`update_scale` here; the class, which
needs DeepSpeed, is defined with the ZeRO optimizer subclass that builds one in place of DeepSpeed's scaler):

* on an overflow, with hysteresis 1 (or ``delayed_shift`` 1): the scale halves, not below ``min_scale``;
  otherwise the hysteresis drops by one; either way the overflow's iteration is remembered;
* without one: the scale doubles when the iterations since the last overflow, minus one, are a positive
  multiple of ``scale_window``, which also refills the hysteresis (refilled every clean step with
  ``consecutive_hysteresis``).

Powers of two are exact in fp32, so the scale sequence and the scaled loss are DeepSpeed's bit for bit
(``tests/train/test_device_loss_scale.py`` against ``DynamicLossScaler`` step for step,
``tests/train/test_device_decided_steps.py`` through an engine), and so are the unscaled gradients except on a
step whose update grows the scale: DeepSpeed unscales them with the grown scale, :mod:`domino.optim.zero_step`
with the one they were computed with. Another difference: at ``min_scale`` an overflow
makes DeepSpeed raise ``Current loss scale already at minimum`` (``raise_error_at_min_scale``); the device
cannot raise, so the scale stays at the minimum and the step is skipped like any other (the interval's
statistics count it, ``domino.optim.zero_step.skip_flag``).

The checkpoint code saves a scaler's fields by name (``domino.optim.state.loss_scaler_fields``
reads these tensors as numbers at save time) and assigns them back by name on load: a number assigned to a
device field is copied into its tensor.
"""

from __future__ import annotations

from typing import Any

import torch

#: The scaler fields that live on the device, with their dtypes.
DEVICE_FIELDS = {"cur_scale": torch.float32, "cur_hysteresis": torch.int64, "last_overflow_iter": torch.int64}


def _dynamic_loss_scaler_class():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler


def is_dynamic(scaler) -> bool:
    """Whether ``scaler`` is (a subclass of) DeepSpeed's DynamicLossScaler."""
    return isinstance(scaler, _dynamic_loss_scaler_class())


def update_scale(self, overflow) -> None:
    """DeepSpeed's ``DynamicLossScaler.update_scale`` with ``overflow`` a 0-d bool tensor (module docstring)."""
    overflow = torch.as_tensor(overflow, device=self.cur_scale.device).reshape(())
    shrink = overflow & ((self.cur_hysteresis == 1) | (self.delayed_shift == 1))
    stable_interval = self.cur_iter - self.last_overflow_iter - 1
    grow = ~overflow & (stable_interval > 0) & (stable_interval % self.scale_window == 0)
    halved = torch.clamp(self.cur_scale / self.scale_factor, min=self.min_scale)
    self.cur_scale.copy_(torch.where(shrink, halved, torch.where(grow, self.cur_scale * self.scale_factor,
                                                                 self.cur_scale)))
    refill = grow | (~overflow & self.consecutive_hysteresis)
    hysteresis = torch.where(overflow & ~shrink, self.cur_hysteresis - 1, self.cur_hysteresis)
    self.cur_hysteresis.copy_(torch.where(refill, torch.full_like(hysteresis, self.delayed_shift), hysteresis))
    self.last_overflow_iter.copy_(torch.where(overflow, torch.full_like(self.last_overflow_iter, self.cur_iter),
                                              self.last_overflow_iter))
    self.cur_iter += 1  # the host counts iterations itself: no value comes back


def fields_to_device(scaler, device) -> None:
    """Turns ``scaler``'s :data:`DEVICE_FIELDS`, plain numbers so far, into 0-d tensors of their dtypes on
    ``device`` (what both device scalers hold; :func:`set_field` copies numbers into them afterwards)."""
    for name, dtype in DEVICE_FIELDS.items():
        object.__setattr__(scaler, name, torch.tensor(getattr(scaler, name), dtype=dtype, device=device))


def set_field(self, name: str, value: Any) -> None:
    """A number assigned to a device field (a checkpoint being restored) is copied into its tensor."""
    current = self.__dict__.get(name)
    if name in DEVICE_FIELDS and isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
        current.fill_(value)
        return
    object.__setattr__(self, name, value)
