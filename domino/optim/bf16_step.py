"""DeepSpeed's bf16 optimizer step with overflow and clipping decided on the device (no host sync).

With ``bf16`` and ZeRO stage 1, DeepSpeed 0.19.8 wraps our torch AdamW in ``BF16_Optimizer``
(``deepspeed/runtime/engine.py``: ``_do_optimizer_sanity_check`` returns ``BFLOAT16`` for bf16 weights with fp32
gradient accumulation at stage 1). Its ``step`` (``deepspeed/runtime/bf16_optimizer.py``) reads two values on
the host every step, each of which drains the GPU's queue:

* ``is_invalid_grad_norm(norm)`` (``deepspeed/runtime/utils.py``): ``bool(~isfinite(norm) | (norm < 0))``, to
  skip the update when the gradients overflowed;
* ``clip_tensors_by_global_norm`` (same file): ``if clip_coef < 1``, to scale the gradients only when the norm
  exceeds ``gradient_clipping``.

No DeepSpeed setting moves either decision to the device (``bf16`` takes ``enabled``, ``immediate_grad_update``
and ``check_grad_overflow``; ``gradient_clipping`` only sets the threshold), so
:class:`~domino.optim.deepspeed_subclasses.DeviceDecidedBF16Optimizer`, the subclass the engine builds in its
place (:mod:`domino.optim.deepspeed_engine`), replaces that one method with :func:`_device_decided_step` and
keeps everything else of DeepSpeed's class: its fp32 gradient buffers, master weights, state dict (checkpoints
are unchanged) and parameter all-gather. The two decisions become tensor
maths with the same results:

* clipping multiplies every fp32 gradient by ``min(1, max_norm / (norm + 1e-6))``; where DeepSpeed skips the
  multiplication (factor >= 1) we multiply by exactly 1.0, so the gradients are bit for bit the same;
* the skip is torch's fused AdamW's own: with the optimizer attribute ``found_inf`` non-zero it leaves
  parameters, moments and step count unchanged (``torch/optim/adam.py`` ``_fused_adam``, torch 2.13), so the
  copy of the unchanged fp32 master weights into the bf16 weights that follows changes nothing either.

The subclass is only built where it is exact (:func:`unsupported`): the inner optimizer is a fused torch
Adam/AdamW (CUDA; CPU from torch 2.4) and the model has no MoE layers. The engine's ``skipped_steps`` no longer
counts skipped steps (the host never learns of one inside the step); :func:`skip_flag` hands the 0/1 device flag
to the interval statistics, which read it with the rest of the interval's numbers.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

#: DeepSpeed's epsilon in ``clip_tensors_by_global_norm`` (deepspeed/runtime/utils.py, 0.19.8).
CLIP_EPS = 1e-6


def _bf16_optimizer_class():
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return BF16_Optimizer


def global_norm(tensors, mpu) -> torch.Tensor:
    """DeepSpeed's ``get_global_norm_of_tensors`` (2-norm, no MoE; ``deepspeed/runtime/utils.py``, 0.19.8)
    without its ``mask_nan_or_inf_with_val_inplace``, which builds ``torch.tensor(-1.0, device=...)`` every call
    (a host-to-device copy the host waits for on a GPU): each tensor's fp32 2-norm (``_foreach_norm``, one
    multi-tensor kernel), the squares summed over ``mpu``'s model-parallel group, the root. A NaN/inf norm stays
    NaN/inf (DeepSpeed masks it to -1); the caller treats both as invalid."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    if tensors:
        squares = torch.stack(torch._foreach_norm([t.detach().float() for t in tensors])).pow(2).sum()
    else:  # a rank holding no gradient still joins the all-reduce (a fill kernel: no copy)
        squares = torch.zeros((), dtype=torch.float32, device=get_accelerator().current_device_name())
    if mpu is not None:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    return squares.pow(0.5)


def _device_decided_step(self, closure=None):
    """``BF16_Optimizer.step`` with the overflow skip and the clip decided on the device."""
    if closure is not None:
        raise NotImplementedError(f"{type(self).__name__} does not support closure.")
    self.overflow = False  # the host does not know: a skip happens on the device (``found_inf``)
    grads_for_norm, _ = self.get_grads_for_norm()
    # The norm over the TP group: tensors and an all-reduce, no host read and no Python number copied over.
    norm = global_norm(grads_for_norm, self.mpu)
    invalid = ~torch.isfinite(norm)
    self._global_grad_norm = torch.where(invalid, torch.full_like(norm, float("inf")), norm)
    if self.clip_grad > 0.0:
        grads = self.get_grads_for_norm(for_clipping=True)
        if grads:
            torch._foreach_mul_(grads, torch.clamp(self.clip_grad / (norm + CLIP_EPS), max=1.0))
    for param_partition, grad_partition in zip(self.fp32_groups_flat_partition,
                                               self.fp32_groups_gradient_flat_partition):
        param_partition.grad = grad_partition  # fp32 accumulation: the buffer is the master weights' gradient
    self.found_inf = invalid.to(torch.float32)
    self.optimizer.found_inf = self.found_inf  # the fused kernel leaves everything unchanged when non-zero
    self.optimizer.step()
    self._lazy_init_hp_params_optimizer_state()
    self.update_lp_params()
    self.clear_hp_grads()


def is_bf16_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is (a subclass of) DeepSpeed's BF16_Optimizer."""
    return isinstance(optimizer, _bf16_optimizer_class())


def fused_torch_adam(optimizer) -> bool:
    """Whether ``optimizer`` (the basic optimizer DeepSpeed wraps) is torch's Adam or AdamW with its fused kernel,
    whose ``found_inf`` the device-decided steps skip with."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(optimizer.defaults.get("fused"))


def unsupported(optimizer) -> Optional[str]:
    """What in DeepSpeed's BF16_Optimizer ``optimizer`` the device-decided step does not handle exactly, or None:
    it needs a fused torch Adam(W) with fp32 gradient accumulation, the 2-norm and no MoE layers."""
    if not fused_torch_adam(optimizer.optimizer):
        return f"the inner optimizer {type(optimizer.optimizer).__name__} is not torch's fused Adam(W)"
    if optimizer.grad_acc_dtype is not torch.float32:
        return f"gradients accumulate in {optimizer.grad_acc_dtype}"
    if optimizer.has_moe_layers or float(optimizer.norm_type) != 2.0 or getattr(optimizer, "_uses_muon", False):
        return "MoE layers, Muon or a norm other than 2"
    return None


def skip_flag(engine) -> Optional[torch.Tensor]:
    """The 0/1 device flag of the last step's on-device skip, or None when the engine's optimizer decides on
    the host (DeepSpeed then counts its skips in ``engine.skipped_steps``)."""
    from domino.optim.deepspeed_subclasses import DeviceDecidedBF16Optimizer  # an engine exists: DeepSpeed is in

    return engine.optimizer.found_inf if isinstance(engine.optimizer, DeviceDecidedBF16Optimizer) else None


def main_gradients(optimizer) -> Dict[torch.nn.Parameter, torch.Tensor]:
    """Each bf16 parameter's fp32 gradient buffer in DeepSpeed's BF16_Optimizer (a view into its flat buffer:
    ``fp32_groups_gradients``), the Megatron ``main_grad`` of a pipelined bf16 run."""
    return {lp: hp for group, grads in zip(optimizer.bf16_groups, optimizer.fp32_groups_gradients)
            for lp, hp in zip(group, grads)}


def main_gradient_buffers(optimizer) -> List[torch.Tensor]:
    """The BF16_Optimizer's flat fp32 gradient buffers (one per parameter group, padding included)."""
    return list(optimizer.fp32_groups_gradients_flat)
