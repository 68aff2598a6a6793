"""DeepSpeed set-up: the engine config derived from our flags, optimizer groups, clipping, and the engine over the mesh."""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from domino.config import ConfigError, DominoConfig
from domino.config.layout import zero_reduces_in_backward
from domino.config.validate import zero_stage_for
from domino.runtime.mesh import ParallelMesh, collective_device
from domino.parallel.layers import is_tensor_model_parallel
from domino.pipeline.gradients import norm_parameters
from domino.train import bf16_step, zero_step
from domino.train.deepspeed_mpu import DeepSpeedMpu


def gradient_accumulation_steps(config: DominoConfig, dp: int) -> int:
    """Micro-batches per optimizer step on each of ``dp`` data-parallel ranks."""
    global_batch = config.train.global_batch_size or config.train.micro_batch_size * dp
    return global_batch // (config.train.micro_batch_size * dp)


def global_batch_size(config: DominoConfig, dp: int) -> int:
    """Samples per optimizer step over all ``dp`` data-parallel ranks (default: micro-batch x DP)."""
    return config.train.global_batch_size or config.train.micro_batch_size * dp


def zero_stage(config: DominoConfig, dp: int) -> int:
    """The run's ZeRO stage: ``--zero-stage``, or its default at ``dp`` data-parallel ranks (``pretrain``
    resolves it into the config; other callers of the engine set-up get the same choice)."""
    return zero_stage_for(config, dp)


def pipelined(config: DominoConfig) -> bool:
    """Whether the run has more than one pipeline stage (the pipeline schedule runs forward and backward)."""
    return config.parallel.pipeline_model_parallel_size > 1


def accumulate(engine, batch: int, samples_per_micro_batch: int) -> Iterator[bool]:
    """Sets ``engine`` up for an optimizer step over a ``batch``-sample global batch and yields, for each of its
    micro-batches (``batch // samples_per_micro_batch``, DP ranks together), whether it ends the step.

    DeepSpeed 0.19.8 (``runtime/engine.py``) divides each micro-batch's loss by the engine's accumulation steps,
    which ``set_train_batch_size`` sets; its own boundary test, ``(micro_steps + 1) % gas == 0`` over the run's
    micro-step count, goes wrong once the batch grows, so the boundary is set before each micro-batch
    (``set_gradient_accumulation_boundary``).
    """
    steps = batch // samples_per_micro_batch
    engine.set_train_batch_size(batch)
    for micro in range(steps):
        engine.set_gradient_accumulation_boundary(micro == steps - 1)
        yield micro == steps - 1


def clips_itself(config: DominoConfig, dp: int) -> bool:
    """Whether domino (not DeepSpeed) clips gradients: plain fp32 data parallelism (ZeRO stage 0), and every
    pipelined run (DeepSpeed's norm would sum over one stage only)."""
    return pipelined(config) or (zero_stage(config, dp) == 0 and not (config.train.fp16 or config.train.bf16))


def clip_gradients(engine, mesh: ParallelMesh, max_norm: float,
                   grad_of: Optional[Callable[[torch.nn.Parameter], Optional[torch.Tensor]]] = None,
                   poison_overflow: bool = False, loss_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Clips the (already data-parallel-reduced) gradients to ``max_norm``; returns the global norm (over the TP,
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
    main gradient, :func:`domino.train.bf16_step.main_gradients`). With ``poison_overflow`` a non-finite norm
    turns every gradient into NaN, so that each stage's optimizer, which looks at its own stage's gradients only,
    skips the step: a skip on one stage is a skip on all (the norm is already summed over every stage).

    ``loss_scale`` (fp16, a device tensor): the gradients still carry it, so the norm is divided by it (and
    returned so) and the gradients stay scaled, clipped by DeepSpeed's factor ``min(1, clip / (norm / scale +
    1e-6))`` (``DeepSpeedZeroOptimizer.unscale_and_clip_grads``, stage_1_and_2.py 0.19.8); the ZeRO optimizer's
    step divides by the scale (:mod:`domino.train.zero_step`, its own clipping off).
    """
    grad_of = grad_of or (lambda p: p.grad)
    params = [p for p in engine.module.parameters() if grad_of(p) is not None]
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


def flag_overflow(engine, grad_norm: torch.Tensor) -> Optional[torch.Tensor]:
    """Makes the coming optimizer step skip itself on the device when ``grad_norm`` is NaN/inf.

    Only for a plain torch optimizer (ZeRO stage 0, fp32): DeepSpeed's own wrappers (ZeRO, fp16, bf16) keep an
    ``overflow`` flag and skip by themselves. torch's fused AdamW reads the optimizer attribute ``found_inf``
    and, when it is non-zero, leaves parameters, moments and step count unchanged (``torch/optim/adam.py``,
    ``_fused_adam``, torch 2.13), so no host read decides the skip. Returns the 0/1 flag, or ``None`` when the
    optimizer is not fused (torch < 2.4 on CPU): the caller then decides on the host.
    """
    optimizer = engine.optimizer
    if not optimizer.defaults.get("fused"):
        return None
    found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
    optimizer.found_inf = found_inf
    return found_inf


def device_skip_flag(engine) -> Optional[torch.Tensor]:
    """The 0/1 device flag of the last step's on-device skip by a DeepSpeed optimizer whose step domino decides
    on the device (:mod:`domino.train.bf16_step`, :mod:`domino.train.zero_step`), else None (DeepSpeed then
    counts its skips in ``engine.skipped_steps``)."""
    flag = bf16_step.skip_flag(engine)
    return flag if flag is not None else zero_step.skip_flag(engine)


#: Elements per ZeRO gradient-reduction / parameter all-gather bucket (DeepSpeed's default is 5e8).
ZERO_BUCKET_ELEMENTS = 5e7


def zero_optimization(config: DominoConfig, dp: int) -> Dict[str, Any]:
    """The ``zero_optimization`` section: gradient reduction overlapped with backward (docs/training.md).

    From DeepSpeed 0.19.8 (``deepspeed/runtime/zero/config.py`` and ``stage_1_and_2.py``): ``overlap_comm``
    defaults to off below stage 3; on, each full bucket's data-parallel reduction is launched on a separate
    ``reduction_stream`` while backward goes on computing earlier layers' gradients. ``contiguous_gradients``
    copies each gradient into one flat buffer as it is produced (no fragmentation, one flat reduction per
    bucket). Buckets of :data:`ZERO_BUCKET_ELEMENTS` elements (100 MB in bf16) are large enough for NCCL to
    reach link bandwidth, and ten times smaller than DeepSpeed's default so the first reduction starts early
    in backward and the double-buffered overlap costs little memory.
    """
    overlapped = zero_reduces_in_backward(config)
    return {"stage": zero_stage(config, dp), "overlap_comm": overlapped, "contiguous_gradients": overlapped,
            "reduce_bucket_size": ZERO_BUCKET_ELEMENTS, "allgather_bucket_size": ZERO_BUCKET_ELEMENTS}


def deepspeed_config(config: DominoConfig, dp: int) -> Dict[str, Any]:
    """The DeepSpeed config for ``config`` at ``dp`` data-parallel ranks; keys from ``--deepspeed-config FILE``
    override ours."""
    t = config.train
    gas = gradient_accumulation_steps(config, dp)
    # Pipelined, the schedule runs every micro-batch of a step: DeepSpeed sees one of gas x the micro-batch.
    micro, gas = (t.micro_batch_size * gas, 1) if pipelined(config) else (t.micro_batch_size, gas)
    ds: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": global_batch_size(config, dp),
        # Without ZeRO or mixed precision DeepSpeed clips but does not report the norm: domino clips then.
        "gradient_clipping": 0.0 if clips_itself(config, dp) else t.clip_grad,
        "zero_optimization": zero_optimization(config, dp),
        "steps_per_print": 10**9,  # domino logs its own lines
        "wall_clock_breakdown": False,
        # DeepSpeed's ThroughputTimer is on by default and calls the accelerator's synchronize() at the start of
        # every forward and the end of every step (deepspeed 0.19.8, utils/timer.py `ThroughputTimer.start/stop`,
        # config in utils/config.py `DeepSpeedThroughputTimerConfig`): two device syncs per micro-batch for a
        # figure domino does not use (it times its own intervals).
        "timers": {"throughput": {"enabled": False}},
        "zero_allow_untested_optimizer": True,
    }
    if t.fp16:
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": round(math.log2(t.initial_loss_scale)),
                      "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if t.bf16:
        # Pipelined, the schedule runs the backward, not DeepSpeed: BF16_Optimizer's per-gradient hooks (its
        # `immediate_grad_update`, deepspeed 0.19.8 runtime/bf16_optimizer.py `create_grad_acc_hooks`) add each
        # micro-batch's bf16 gradient into its fp32 buffer as autograd finishes it, in any backward; its PipelineEngine
        # calls `update_hp_grads` after each micro-batch's backward instead (runtime/pipe/engine.py
        # `_exec_backward_pass`), which torch's schedule gives no place for.
        ds["bf16"] = {"enabled": True, **({"immediate_grad_update": True} if pipelined(config) else {})}
        # Gradients of bf16 weights are summed over micro-batches (and DP ranks) in fp32: with ZeRO 1 this selects
        # DeepSpeed's BF16_Optimizer (fp32 master weights and gradient buffers), with ZeRO 2 the ZeRO optimizer's
        # fp32 gradient partitions (deepspeed 0.19.8, runtime/engine.py `_do_optimizer_sanity_check` and
        # `_configure_zero_optimizer`). Without it bf16 gradients accumulate in bf16 and lose small updates.
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        # The data-parallel sums in fp32 too: DeepSpeed reduces in bf16 unless told otherwise (runtime/engine.py,
        # `communication_data_type`: bf16 when bf16 is enabled and the key unset). ZeRO 1's BF16_Optimizer would
        # round its accumulated fp32 buffers to bf16 for the all-reduce; ZeRO 2 reduces each micro-batch's bf16
        # gradients as they come and adds the fp32 result to its fp32 partition (runtime/zero/stage_1_and_2.py,
        # `_add_full_reduction_to_compact_grad_partition`), where a bf16 reduction would round every partial sum
        # of the ranks' gradients. Megatron-LM reduces bf16 gradients in fp32 unless `--grad-reduce-in-bf16`
        # (which its examples/llama/train_llama3_8b_h100_fp8.sh at 157006d opts into); ZeRO 2 sends twice the
        # bytes for it.
        ds["communication_data_type"] = "fp32"
    if t.deepspeed_config:
        try:
            with open(t.deepspeed_config) as f:
                overrides = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(f"--deepspeed-config {t.deepspeed_config}: cannot read JSON: {error}") from error
        if not isinstance(overrides, dict):
            raise ConfigError(f"--deepspeed-config {t.deepspeed_config}: must hold a JSON object")
        _deep_update(ds, overrides)
    return ds


def _deep_update(base: Dict[str, Any], overrides: Dict[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Two AdamW groups: weights with decay; biases and LayerNorm parameters (all 1-D) without."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_engine(model: torch.nn.Module, config: DominoConfig, mesh: ParallelMesh):
    """Wraps ``model`` in a DeepSpeed engine with torch AdamW, over ``mesh`` (DeepSpeed's ``mpu``:
    :class:`~domino.train.deepspeed_mpu.DeepSpeedMpu`).

    The model is moved to its device first, so the optimizer is built over device parameters (fused AdamW
    refuses CPU parameters on torch < 2.4). A torch AdamW rather than DeepSpeed's fused Adam, so CPU runs need
    no JIT build; its fused kernel wherever torch has one (:func:`fused_optimizer_supported`), which also lets
    a non-finite step be skipped on the device (:func:`flag_overflow`).
    """
    import deepspeed  # after initialize_runtime set DS_ACCELERATOR (DeepSpeed picks its accelerator at import)

    t = config.train
    device = collective_device(mesh.tp.process_group)
    model.to(device)
    fused = fused_optimizer_supported(device)
    optimizer = torch.optim.AdamW(
        optimizer_param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps, fused=fused or None, foreach=None if fused else True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(config, mesh.dp.size),
                                           mpu=DeepSpeedMpu(mesh))
    # Overflow, loss scale and clipping decided on the device: bf16 ZeRO 1 (BF16_Optimizer), fp16/fp32 ZeRO 1/2 and
    # bf16 ZeRO 2 (DeepSpeedZeroOptimizer, which also skips its collectives over a one-rank DP group).
    bf16_step.install(engine) or zero_step.install(engine)
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
    return engine
