"""DeepSpeed's ZeRO 1/2 optimizer step with overflow, loss scale and clipping decided on the device.

DeepSpeed 0.19.8 wraps our torch AdamW in ``DeepSpeedZeroOptimizer`` (``deepspeed/runtime/zero/stage_1_and_2.py``)
at ZeRO 1 and 2 for fp16 and fp32, and at ZeRO 2 for bf16 (bf16 ZeRO 1 is ``BF16_Optimizer``:
:mod:`domino.optim.bf16_step`). Its ``step`` reads on the host, every step:

* ``has_overflow`` (fp16 and bf16, ``check_grad_overflow``): the inf/NaN count of the gradient partitions,
  all-reduced, then ``overflow_gpu[0].item()``;
* ``is_invalid_grad_norm(scaled_global_grad_norm)``: ``bool(~isfinite(norm) | (norm < 0))``;
* ``loss_scaler.update_scale(overflow)``: needs that ``bool`` (``deepspeed/runtime/fp16/loss_scaler.py``);
* ``unscale_and_clip_grads``: ``if self.clip_grad == 0.0 and self.loss_scale == 1.0``, once per parameter
  group, a read as soon as the scale is a device number.

:class:`~domino.optim.deepspeed_subclasses.DeviceDecidedZeroOptimizer`, the subclass the engine builds in its
place (:mod:`domino.optim.deepspeed_engine`), replaces ``step`` with the same sequence as tensor maths
(:func:`_device_decided_step`) and keeps everything else of DeepSpeed's class
(gradient partitions and buckets, fp32 master partitions, state dict, all-gather):

* the skip is torch's fused AdamW's own: with the optimizer attribute ``found_inf`` non-zero it leaves
  parameters, moments and step count unchanged (``torch/optim/adam.py`` ``_fused_adam``, torch 2.13), so the
  copy of the unchanged fp32 master partition into the 16-bit weights that follows changes nothing either;
* the scale update is :class:`domino.optim.deepspeed_subclasses.DeviceLossScaler` (fp16 dynamic scaling,
  :mod:`domino.optim.device_loss_scale`);
* with pipeline stages the skip is the same on every stage: DeepSpeed reduces the overflow and the norm over DP
  and its ``mpu``'s model-parallel group (TP) only, so a stage with finite gradients would step while another
  skips;
* the gradients are multiplied by ``1 / (max(1, (norm / scale + 1e-6) / clip) * scale)``, DeepSpeed's factor;
  where DeepSpeed skips the multiplication (no clipping, scale 1) we multiply by exactly 1.0. ``scale`` is the
  one the gradients were computed with: DeepSpeed updates the scale first and unscales with the new one, so on
  a step where the scale doubles its unclipped gradients come out halved (clipped ones almost unchanged:
  the factor is ``norm / clip`` then, but for the ``1e-6`` term); Megatron-LM unscales before it updates
  (``megatron/core/optimizer/optimizer.py`` at 0011998, ``MixedPrecisionOptimizer.prepare_grads``), and so do
  we.

With one data-parallel replica DeepSpeed still reduces every gradient bucket over the one-rank group (the
``dist.all_reduce``/``dist.reduce`` of ``allreduce_bucket`` and ``gradient_reduction_w_predivide``), only to
move gradients into the partition; the subclass does the same copies and casts without the collective (the
mean over one replica is the identity; gradient averaging divides by ``world size / sequence-parallel size``,
1.0, skipped as DeepSpeed's own ``gradient_predivide_factor`` branch skips it).

A pipelined step hands the optimizer gradients it has averaged over the replicas itself:
:func:`take_reduced_gradients` moves each rank's slice into the partition without DeepSpeed's second reduction
(for DeepSpeed's own class too, which a CP run builds).

The subclass is only built where it is exact (:func:`unsupported`): a fused torch Adam/AdamW, no CPU offload,
MoE, ZenFlow, torch autocast scaler, external loss scale or DeepSpeed sequence parallelism. The engine's
``skipped_steps`` no longer counts skips; :func:`skip_flag` hands the 0/1 device flag to the interval
statistics, which read it with the rest of the interval's numbers.
"""

from __future__ import annotations

from typing import Optional

import torch

from domino.optim import bf16_step, device_loss_scale


def _zero_optimizer_class():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def _one_rank(group) -> bool:
    from deepspeed import comm as dist

    return dist.get_world_size(group=group) == 1


def _device_decided_step(self, closure=None):
    """``DeepSpeedZeroOptimizer.step`` (no offload) with the skip, scale and clip decided on the device."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import all_gather_dp_groups
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    if closure is not None:
        raise NotImplementedError(f"{type(self).__name__} does not support closure.")
    self.micro_step_id = INITIAL_MICRO_STEP_ID
    self.overflow = False  # the host does not know: a skip happens on the device (``found_inf``)
    prev_scale = self.loss_scale  # the scale this step's gradients carry: a copy, the update below is in place
    prev_scale = prev_scale.clone() if isinstance(prev_scale, torch.Tensor) else prev_scale
    scaled_norm = self.scaled_global_norm()  # inf when any group's norm is not finite
    # DeepSpeed skips on an invalid norm unless the weights are bf16 with check_grad_overflow off.
    invalid = (~torch.isfinite(scaled_norm) | (scaled_norm < 0)) & (
        self.dtype != torch.bfloat16 or self.check_grad_overflow)
    if self.check_grad_overflow:
        # DeepSpeed's has_overflow without its .item(): the partitions' inf/NaN count, the max over DP and TP.
        overflow = self.has_overflow_partitioned_grads_serial().to(torch.uint8)
        if not _one_rank(self.dp_process_group):
            dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=overflow, op=dist.ReduceOp.MAX)
        invalid = invalid | overflow.reshape(()).bool()
    pp = self.mpu.mesh.pp  # the engine's mpu is the mesh's (domino.optim.deepspeed_mpu), kept by the optimizer
    if pp.size > 1:
        # DeepSpeed's norm and overflow span DP and TP only (its mpu's model-parallel group is TP); every stage
        # skips when any stage's gradients are not finite, as domino's clipping norm spans the stages.
        flag = invalid.to(torch.uint8).reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=pp.process_group)
        invalid = flag.reshape(()).bool()
    if device_loss_scale.is_dynamic(self.loss_scaler):
        self._update_scale(invalid)  # a static scaler (bf16's 1.0) has nothing to update
    self._global_grad_norm = torch.where(invalid, torch.full_like(scaled_norm, float("inf")),
                                         scaled_norm / prev_scale)
    self.found_inf = invalid.to(torch.float32)
    self.optimizer.found_inf = self.found_inf  # the fused kernel leaves everything unchanged when non-zero
    for i in range(len(self.bit16_groups)):
        partition_id = dist.get_rank(group=self.real_dp_process_group[i])
        self.free_grad_in_param_list(self.params_not_in_partition[i])
        flat_grad_partition = self._get_preflattened_grad_partition(i)
        if flat_grad_partition is None:
            if partition_id == dist.get_world_size(group=self.real_dp_process_group[i]) - 1:
                flat_grad_partition = self.flatten_dense_tensors_aligned(self.averaged_gradients[i],
                                                                         int(self.partition_size[i]))
            else:
                flat_grad_partition = self.flatten(self.averaged_gradients[i])
        single_grad_partition = flat_grad_partition.to(self.single_partition_of_fp32_groups[i].dtype)
        del flat_grad_partition
        self.single_partition_of_fp32_groups[i].grad = single_grad_partition
        self.free_grad_in_param_list(self.params_in_partition[i])
        self._release_preflattened_grad_buffers(i)
        self.averaged_gradients[i] = None
        self.all_grad_tensors[i] = None
        self._unscale_and_clip(single_grad_partition, scaled_norm, prev_scale)
        self._optimizer_step(i)
        self.single_partition_of_fp32_groups[i].grad = None
        del single_grad_partition
        self.parallel_partitioned_bit16_groups[i][partition_id].data.copy_(
            self.single_partition_of_fp32_groups[i].data)
    all_gather_dp_groups(groups_flat=self.bit16_groups_flat, partitioned_param_groups=self.parallel_partitioned_bit16_groups,
                         dp_process_group=self.real_dp_process_group,
                         start_alignment_factor=self.nccl_start_alignment_factor,
                         allgather_bucket_size=self.allgather_bucket_size)
    for i in range(len(self.bit16_groups)):
        self._update_model_bit16_weights(i)


def take_reduced_gradients(optimizer) -> None:
    """Hands DeepSpeed's ZeRO 1 optimizer ``optimizer`` (domino's subclass or DeepSpeed's own class) the gradients
    in the parameters' ``.grad`` as they are: a pipelined step has averaged them over DP x CP and clipped them
    already (:mod:`domino.train.pipeline_step`), so each rank keeps its own partition's slice, with no collective.

    DeepSpeed 0.19.8's ``reduce_gradients`` (``engine.allreduce_gradients`` at ZeRO 1; ``runtime/zero/
    stage_1_and_2.py``) all-reduces every gradient over the optimizer's data-parallel group (DP x CP) and divides by
    DP (``reduce_independent_p_g_buckets_and_remove_grads`` -> ``reduce_ipg_grads`` -> ``buffered_reduce_fallback``
    -> ``allreduce_bucket``, in place in ``.grad`` without ``contiguous_gradients``), then its
    ``independent_gradient_partition_epilogue`` does what this does: ``all_grad_tensors[i]`` from
    ``get_all_grad_tensors(params_in_partition[i])`` (the ``.grad`` tensors), ``averaged_gradients[i]`` from them by
    ``finalize_gradient_accumulation_boundary`` (``get_flat_partition``: this rank's slice of each, what the
    engine's own step finalises where the gradients were reduced in backward), ``.grad`` cleared
    (``_clear_param_grad_only``). ``step`` reads ``averaged_gradients[i]`` only: the overflow check
    (``has_overflow_partitioned_grads_serial``), the norm (``scaled_global_norm``) and the flat partition it copies
    into ``single_partition_of_fp32_groups[i].grad``; fp16's still-scaled gradients reach all three unchanged.

    Raises:
        RuntimeError: the optimizer reduces in its backward hooks, into compact or offloaded partitions (ZeRO 2,
            ``overlap_comm``, ``contiguous_gradients``, a separate accumulation dtype, CPU offload), where
            ``.grad`` is not where its gradients wait.
    """
    hooked = {"ZeRO 2": optimizer.partition_gradients, "overlap_comm": optimizer.overlap_comm,
              "contiguous_gradients": optimizer.contiguous_gradients, "CPU offload": optimizer.cpu_offload,
              "a separate accumulation dtype": optimizer.use_grad_accum_attribute or any(
                  optimizer._use_compact_grad_partition_buffer(i) for i in range(len(optimizer.bit16_groups)))}
    present = [name for name, on in hooked.items() if on]
    if present:
        raise RuntimeError(f"the ZeRO optimizer keeps its gradients outside .grad ({', '.join(present)}): a "
                           "pipelined step hands it .grad only at ZeRO 1 without them")
    for i in range(len(optimizer.bit16_groups)):
        optimizer.all_grad_tensors[i] = optimizer.get_all_grad_tensors(
            optimizer.params_in_partition[i], dtype=optimizer.gradient_accumulation_dtype)
    optimizer.finalize_gradient_accumulation_boundary()
    optimizer._clear_param_grad_only()


def _grad_norm_direct(self, gradients, params, norm_type=2):
    """DeepSpeed's ``get_grad_norm_direct`` (2-norm; ``deepspeed/runtime/zero/stage_1_and_2.py``, 0.19.8) without
    ``mask_nan_or_inf_with_val_inplace``, which builds ``torch.tensor(-1.0, device=...)`` per parameter group
    and step (a host-to-device copy the host waits for on a GPU): a NaN/inf norm stays NaN/inf, which
    ``combine_grad_norm_groups`` turns into inf as it does DeepSpeed's -1. One ``_foreach_norm`` per group instead
    of a norm per gradient; a rank with no counted gradient contributes a zero made by a fill kernel."""
    from deepspeed import comm as dist
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if float(norm_type) != 2.0:
        return _zero_optimizer_class().get_grad_norm_direct(self, gradients, params, norm_type)
    counted = []
    for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue  # pipeline-replicated parameters are counted once
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            counted.append(g.data.to(get_norm_dtype()).detach())
    if counted:
        total = torch.stack(torch._foreach_norm(counted)).pow(2).sum().float()
    else:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
    if not _one_rank(self.dp_process_group):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    return total.pow(0.5)


def _unscale_and_clip(self, grad: torch.Tensor, scaled_norm: torch.Tensor, scale) -> None:
    """DeepSpeed's ``unscale_and_clip_grads`` factor, applied without asking the host whether it is 1."""
    if self.clip_grad == 0.0 and not isinstance(scale, torch.Tensor) and scale == 1.0:
        return  # a Python 1.0 (bf16's static scaler): known on the host, nothing to do
    combined = scale
    if self.clip_grad > 0.0:
        clip = torch.clamp(((scaled_norm / scale) + 1e-6) / self.clip_grad, min=1.0)  # the norm is norm * scale
        combined = clip * scale
    grad.data.mul_(1.0 / combined)


def _allreduce_bucket(self, bucket, communication_data_type, rank=None, log=None, divide=True, process_group=None):
    """``allreduce_bucket`` without the collective when the group is this rank alone."""
    from deepspeed.runtime.zero.stage_1_and_2 import pg_correctness_test

    group = self.dp_process_group if process_group is None else process_group
    if not _one_rank(group) or self.sequence_parallel_size != 1:
        return _zero_optimizer_class().allreduce_bucket(self, bucket, communication_data_type, rank=rank, log=log,
                                                        divide=divide, process_group=process_group)
    tensor = self.flatten(bucket)
    reduced = tensor.to(torch.float32 if pg_correctness_test else communication_data_type)
    if reduced is not tensor:  # DeepSpeed's cast there and back, kept: the same rounding as with the collective
        tensor.copy_(reduced)
    return reduced


def _gradient_reduction_w_predivide(self, tensor, communication_data_type):
    """``gradient_reduction_w_predivide`` without the collective when the data-parallel group is this rank."""
    if not (_one_rank(self.dp_process_group) and self.sequence_parallel_size == 1
            and self.gradient_predivide_factor == 1.0):
        return _zero_optimizer_class().gradient_reduction_w_predivide(self, tensor, communication_data_type)
    if tensor.numel() == 0:
        return tensor
    reduced = tensor.to(communication_data_type)
    if reduced is not tensor:
        tensor.copy_(reduced)
    return reduced


def _muon_update_lacks_loss_scale(self, group_index) -> bool:
    """DeepSpeed's test with its two conditions swapped: the set, filled only by Muon updates (never with the
    fused Adam this class requires), first, so the device scale is not compared on the host."""
    return group_index in self.groups_lacking_loss_scale and bool(self.loss_scale != 1.0)


def unsupported(optimizer) -> Optional[str]:
    """What in DeepSpeed's ZeRO 1/2 optimizer ``optimizer`` the device-decided step does not handle exactly, or
    None: it needs a fused torch Adam(W), the gradient norm computed, and none of CPU offload, MoE, ZenFlow,
    torch autocast's scaler, an external loss scale or DeepSpeed sequence parallelism."""
    if not bf16_step.fused_torch_adam(optimizer.optimizer):
        return f"the inner optimizer {type(optimizer.optimizer).__name__} is not torch's fused Adam(W)"
    features = {"compute_grad_norm off": not optimizer.compute_grad_norm, "CPU offload": optimizer.cpu_offload,
                "MoE layers": optimizer.has_moe_layers, "ZenFlow": optimizer.zenflow,
                "an external loss scale": optimizer.custom_loss_scaler,
                "torch autocast's GradScaler": optimizer.torch_autocast_gradscaler is not None,
                "sequence parallelism": optimizer.sequence_parallel_size != 1}
    present = [name for name, on in features.items() if on]
    return ", ".join(present) if present else None


def skip_flag(engine) -> Optional[torch.Tensor]:
    """The 0/1 device flag of the last step's on-device skip, or None when the engine's optimizer is not the
    device-decided ZeRO optimizer."""
    from domino.optim.deepspeed_subclasses import DeviceDecidedZeroOptimizer  # an engine exists: DeepSpeed is in

    return engine.optimizer.found_inf if isinstance(engine.optimizer, DeviceDecidedZeroOptimizer) else None
