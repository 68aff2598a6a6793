"""Gradient clipping and the device-decided skip of a torch optimizer: torch only, whichever optimizer steps.

The norm and the skip stay device tensors (no host read in the step): the loop, the pipeline step and every
optimizer behind :class:`domino.optim.interface.TrainingOptimizer` share these.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from domino.parallel.layers import is_tensor_model_parallel
from domino.pipeline.gradients import norm_parameters
from domino.runtime.mesh import ParallelMesh


def clip_gradients(parameters: Iterable[torch.nn.Parameter], mesh: ParallelMesh, max_norm: float,
                   grad_of: Optional[Callable[[torch.nn.Parameter], Optional[torch.Tensor]]] = None,
                   poison_overflow: bool = False, loss_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Clips the (already data-parallel-reduced) gradients of ``parameters`` to ``max_norm``; returns the global norm (over the TP,
    pipeline and DP groups of ``mesh``) on the device.

    The maths of DeepSpeed's ``clip_grad_norm_`` (``deepspeed/runtime/utils.py``, 0.19.8): the 2-norm of every
    gradient in fp32, a parameter counted once across tensor-parallel ranks unless it carries
    ``tensor_model_parallel=True`` (so replicated LayerNorm weights are not double counted), the squares summed
    over the TP group (and over the pipeline stages, leaving out the last stage's copy of the tied embeddings as
    Megatron's ``param_is_not_shared`` does) and the result averaged over the data-parallel group, then every
    gradient scaled by
    ``min(1, max_norm / (norm + 1e-6))``. Here with torch's multi-tensor kernels (``_foreach_norm``,
    ``_foreach_mul_``: one call each instead of a Python iteration per parameter; 2.2 ms instead of 3.0 per call at
    the end-to-end benchmark's shape, ``benchmarks/RESULTS.md``) and each collective only where its group has more
    than one rank. Nothing is read on the host, nor is a Python number copied to the device: the norm and the
    factor stay tensors.

    ``grad_of(param)`` is where a parameter's gradient lives (default ``param.grad``; a pipelined bf16 run's fp32
    main gradient, :func:`domino.optim.bf16_step.main_gradients`). With ``poison_overflow`` a non-finite norm
    turns every gradient into NaN, so that each stage's optimizer, which looks at its own stage's gradients only,
    skips the step: a skip on one stage is a skip on all (the norm is already summed over every stage).

    ``loss_scale`` (fp16, a device tensor): the gradients still carry it, so the norm is divided by it (and
    returned so) and the gradients stay scaled, clipped by DeepSpeed's factor ``min(1, clip / (norm / scale +
    1e-6))`` (``DeepSpeedZeroOptimizer.unscale_and_clip_grads``, stage_1_and_2.py 0.19.8); the ZeRO optimizer's
    step divides by the scale (:mod:`domino.optim.zero_step`, its own clipping off).
    """
    grad_of = grad_of or (lambda p: p.grad)
    params = [p for p in parameters if grad_of(p) is not None]
    grads = [grad_of(p) for p in params]
    first_tp_rank = mesh.tp.rank == 0
    counted = [grad_of(p).float() for p in norm_parameters(params) if first_tp_rank or is_tensor_model_parallel(p)]
    squares = (torch.stack(torch._foreach_norm(counted)).pow(2).sum() if counted
               else torch.zeros((), device=grads[0].device))
    if mesh.tp.size > 1:
        torch.distributed.all_reduce(squares, group=mesh.tp.process_group)
    if mesh.pp.size > 1:
        torch.distributed.all_reduce(squares, group=mesh.pp.process_group)
    norm = squares.pow(0.5)
    dp = mesh.dp.size
    if dp > 1:  # as DeepSpeed: the mean of the replicas' norms (equal, as their gradients are already reduced)
        norm = norm / dp
        torch.distributed.all_reduce(norm, group=mesh.dp.process_group)
    if loss_scale is not None:
        norm = norm / loss_scale
    if max_norm > 0 or poison_overflow:
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else torch.ones_like(norm)
        if poison_overflow:
            factor = torch.where(torch.isfinite(norm), factor, torch.full_like(factor, float("nan")))
        torch._foreach_mul_(grads, factor)
    return norm


def fused_optimizer_supported(device: torch.device) -> bool:
    """Whether torch's fused AdamW runs on ``device`` (CUDA; CPU from torch 2.4, which added the CPU kernel)."""
    if device.type == "cuda":
        return True
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return device.type == "cpu" and (major, minor) >= (2, 4)


def flag_overflow(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> Optional[torch.Tensor]:
    """Makes ``optimizer``'s coming step skip itself on the device when ``grad_norm`` is NaN/inf.

    For a plain torch optimizer (ZeRO stage 0: fp32, or bf16/fp16 on fp32 masters); DeepSpeed's own wrappers
    (ZeRO, bf16) keep an ``overflow`` flag and skip by themselves. torch's fused AdamW reads the optimizer
    attribute ``found_inf`` and, when it is non-zero, leaves parameters, moments and step count unchanged (``torch/optim/adam.py``,
    ``_fused_adam``, torch 2.13), so no host read decides the skip. Returns the 0/1 flag, or ``None`` when the
    optimizer is not fused (torch < 2.4 on CPU): the caller then decides on the host.
    """
    if not optimizer.defaults.get("fused"):
        return None
    found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
    optimizer.found_inf = found_inf
    return found_inf


def skip_non_finite(optimizer: torch.optim.Optimizer, model: torch.nn.Module, grad_norm: torch.Tensor
                    ) -> torch.Tensor:
    """Makes a plain torch optimizer's coming step skip itself when ``grad_norm`` is NaN/inf; returns the 0/1 flag.

    On the device where the optimizer is fused (:func:`flag_overflow`); elsewhere (torch < 2.4 on CPU) decided on
    the host: the step then runs at learning rate 0 on zeroed gradients (``model``'s, zeroed in place), which
    leaves the weights as they are (the loop sets the next step's rate again).
    """
    flag = flag_overflow(optimizer, grad_norm)
    if flag is None:
        flag = (~torch.isfinite(grad_norm)).to(torch.float32)
        if bool(flag):  # a host read, only without the fused kernel
            for group in optimizer.param_groups:
                group["lr"] = 0.0
            model.zero_grad(set_to_none=False)
    return flag
