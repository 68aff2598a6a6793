"""DeepSpeed's engine, made once as a subclass that builds domino's device-decided optimizers at construction.

DeepSpeed 0.19.8 builds its optimizer wrappers inside the engine's constructor (``deepspeed/runtime/engine.py``:
``DeepSpeedEngine.__init__`` -> ``_configure_optimizer`` -> ``_configure_bf16_optimizer`` constructs
``BF16_Optimizer``, ``_configure_zero_optimizer`` constructs ``DeepSpeedZeroOptimizer``, each by its module-level
name), and ``deepspeed.initialize`` constructs the engine by its module-level name too: neither has a hook for
another class. So :class:`DominoDeepSpeedEngine` overrides those two methods, building
:class:`~domino.optim.deepspeed_subclasses.DeviceDecidedBF16Optimizer` and
:class:`~domino.optim.deepspeed_subclasses.DeviceDecidedZeroOptimizer` with exactly the arguments DeepSpeed's
methods pass (``tests/train/test_deepspeed_engine.py`` compares the two calls' source, so an upgrade that changes
one fails there), where the device-decided step is exact; elsewhere DeepSpeed's own method runs. :func:`initialize`
is ``deepspeed.initialize`` (``deepspeed/__init__.py``) for what domino builds: a plain module, no pipeline module,
no hybrid engine, no ``tp_model_init``, no AutoTP and no DeepSpeed mesh device.

Imports DeepSpeed: imported by :func:`domino.optim.deepspeed_optimizer.build_deepspeed_optimizer` only.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.runtime import zero
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.tensor_parallel.init_utils import merge_tp_model_init_into_config
from deepspeed.runtime.torch_autocast import is_autocast_initialized
from deepspeed.runtime.utils import DummyOptim
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.utils import groups, log_dist, logger
from deepspeed.utils.timer import NoopTimer

from domino.optim import bf16_step
from domino.optim.deepspeed_subclasses import DeviceDecidedBF16Optimizer, DeviceDecidedZeroOptimizer


class DominoDeepSpeedEngine(DeepSpeedEngine):
    """DeepSpeed's engine whose bf16 and ZeRO 1/2 optimizer wrappers are domino's device-decided subclasses
    wherever their steps are exact (the module docstring); built by :func:`initialize`."""

    def _bf16_unsupported(self, optimizer) -> Optional[str]:
        """Why ``BF16_Optimizer``'s device-decided step would not be exact here, read from what DeepSpeed's
        ``_configure_bf16_optimizer`` passes (:func:`domino.optim.bf16_step.unsupported` on the built object)."""
        if not bf16_step.fused_torch_adam(optimizer):
            return "not torch's fused Adam(W)"
        if self.get_data_types()[1] is not torch.float32 or self.has_moe_layers:
            return "gradients not accumulated in fp32, or MoE layers"
        return None

    def _configure_bf16_optimizer(self, optimizer):
        """DeepSpeed 0.19.8's ``DeepSpeedEngine._configure_bf16_optimizer`` (``runtime/engine.py``) constructing
        :class:`~domino.optim.deepspeed_subclasses.DeviceDecidedBF16Optimizer` where its step is exact."""
        if self._bf16_unsupported(optimizer) is not None:
            return super()._configure_bf16_optimizer(optimizer)
        clip_grad = self.gradient_clipping()
        log_dist('Creating BF16 optimizer (DeviceDecidedBF16Optimizer)', ranks=[0])
        timers = self.timers if self.wall_clock_breakdown() else NoopTimer()
        optimizer = DeviceDecidedBF16Optimizer(optimizer,
                                               self.param_names,
                                               bfloat16_config=self._config.bfloat16_config,
                                               mpu=self.mpu,
                                               clip_grad=clip_grad,
                                               allgather_bucket_size=self.zero_allgather_bucket_size(),
                                               dp_process_group=self.seq_data_parallel_group,
                                               timers=timers,
                                               grad_acc_dtype=self.get_data_types()[1],
                                               has_moe_layers=self.has_moe_layers)
        return optimizer

    def _zero_unsupported(self, optimizer) -> Optional[str]:
        """Why ``DeepSpeedZeroOptimizer``'s device-decided step would not be exact here, read from what DeepSpeed's
        ``_configure_zero_optimizer`` passes and from what the optimizer's ``__init__`` reads
        (``runtime/zero/stage_1_and_2.py``: ``cpu_offload`` from ``offload_optimizer_config``, ``zenflow`` from
        ``zenflow_config``, ``torch_autocast_gradscaler`` from ``is_autocast_initialized``,
        ``sequence_parallel_size`` from ``groups._get_sequence_parallel_world_size``);
        :func:`domino.optim.zero_step.unsupported` checks the built object."""
        offload = self.zero_offload_optimizer()
        problems = {
            "not torch's fused Adam(W)": not bf16_step.fused_torch_adam(optimizer),
            "ZeRO 3 or legacy stage 1": (self.zero_optimization_stage() > ZeroStageEnum.gradients
                                         or self.zero_legacy_stage1()),
            "compute_grad_norm off": not self.zero_compute_grad_norm(),
            "CPU offload": offload is not None and offload.device != OffloadDeviceEnum.none,
            "MoE layers": self.has_moe_layers,
            "ZenFlow": self.zenflow or self.zenflow_config() is not None,
            "torch autocast": is_autocast_initialized(),
            "sequence parallelism": groups._get_sequence_parallel_world_size() != 1,
        }
        present = [name for name, on in problems.items() if on]
        return ", ".join(present) if present else None

    def _configure_zero_optimizer(self, optimizer):
        """DeepSpeed 0.19.8's ``DeepSpeedEngine._configure_zero_optimizer`` (``runtime/engine.py``), ZeRO 1/2
        branch, constructing :class:`~domino.optim.deepspeed_subclasses.DeviceDecidedZeroOptimizer` where its
        step is exact."""
        if self._zero_unsupported(optimizer) is not None:
            return super()._configure_zero_optimizer(optimizer)
        zero_stage = self.zero_optimization_stage()

        model_dtype, gradient_accumulation_dtype = self.get_data_types()

        if self.bfloat16_enabled():
            check_grad_overflow = self._config.bfloat16_config.check_grad_overflow
        elif self.fp16_enabled():
            check_grad_overflow = True
        else:
            check_grad_overflow = False

        timers = self.timers if self.wall_clock_breakdown() else NoopTimer()

        overlap_comm = self.zero_overlap_comm()
        contiguous_gradients = self.zero_contiguous_gradients()
        round_robin_gradients = self.zero_round_robin_gradients()
        assert not isinstance(optimizer, DummyOptim), "zero stage {} requires an optimizer".format(zero_stage)

        log_dist(f'Creating {model_dtype} ZeRO stage {zero_stage} optimizer (DeviceDecidedZeroOptimizer)',
                 ranks=[0])

        if isinstance(self.module, PipelineModule):
            if overlap_comm:
                logger.warning("Pipeline parallelism does not support overlapped communication, will be disabled.")
                overlap_comm = False

        optimizer = DeviceDecidedZeroOptimizer(
            optimizer,
            self.param_names,
            timers=timers,
            optimizer_params=self.optimizer_params(),
            static_loss_scale=self.loss_scale(),
            dynamic_loss_scale=self.dynamic_loss_scale(),
            dynamic_loss_args=self.dynamic_loss_scale_args(),
            clip_grad=self.gradient_clipping(),
            contiguous_gradients=contiguous_gradients,
            reduce_bucket_size=self.zero_reduce_bucket_size(),
            use_multi_rank_bucket_allreduce=self.zero_multi_rank_bucket_allreduce(),
            allgather_bucket_size=self.zero_allgather_bucket_size(),
            dp_process_group=self.seq_data_parallel_group,
            expert_parallel_group=self.expert_parallel_group if self.has_moe_layers else None,
            expert_data_parallel_group=self.expert_data_parallel_group if self.has_moe_layers else None,
            reduce_scatter=self.zero_reduce_scatter(),
            overlap_comm=overlap_comm,
            offload_optimizer_config=self.zero_offload_optimizer(),
            zenflow_config=self.zenflow_config(),
            mpu=self.mpu,
            postscale_gradients=self.postscale_gradients(),
            gradient_predivide_factor=self.gradient_predivide_factor(),
            gradient_average=self.gradient_average,
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            ignore_unused_parameters=self.zero_ignore_unused_parameters(),
            partition_grads=zero_stage == ZeroStageEnum.gradients,
            round_robin_gradients=round_robin_gradients,
            parameter_alignment=self.zero_parameter_alignment(),
            has_moe_layers=self.has_moe_layers,
            fp16_master_weights_and_gradients=self.fp16_master_weights_and_gradients(),
            bf16_master_weights_and_gradients=self.bf16_master_weights_and_gradients(),
            bf16_optimizer_states=self.bf16_optimizer_states(),
            gradient_accumulation_dtype=gradient_accumulation_dtype,
            communication_data_type=self.communication_data_type,
            elastic_checkpoint=self.zero_elastic_checkpoint(),
            check_grad_overflow=check_grad_overflow,
            compute_grad_norm=self.zero_compute_grad_norm())
        return optimizer


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Dict[str, Any],
               mpu: Any) -> DominoDeepSpeedEngine:
    """``deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)[0]`` with
    :class:`DominoDeepSpeedEngine` for ``DeepSpeedEngine``: DeepSpeed 0.19.8's ``initialize``
    (``deepspeed/__init__.py``) for a module that is no ``PipelineModule``, a config without ``hybrid_engine``,
    ``data_parallel_size``/``sequence_parallel_size`` (no mesh device) or ``tensor_parallel`` (no AutoTP), none of
    which domino uses.

    Args:
        model: the module to train (its parameters on their device).
        optimizer: the basic torch optimizer DeepSpeed wraps.
        config: DeepSpeed's config as a dict (:func:`domino.optim.deepspeed_config.deepspeed_config`).
        mpu: the mesh in Megatron's ``mpu`` interface (:class:`domino.optim.deepspeed_mpu.DeepSpeedMpu`).

    Returns:
        The engine (``engine.optimizer`` is its optimizer wrapper).
    """
    import deepspeed

    unhandled = [key for key in ("hybrid_engine", "data_parallel_size", "sequence_parallel_size", "tensor_parallel")
                 if key in config]
    if isinstance(model, PipelineModule) or unhandled:
        raise ValueError(f"domino's engine is built for a plain module and config: {unhandled or 'PipelineModule'}")
    # deepspeed/__init__.py, initialize(): the same calls in the same order.
    zero.partition_parameters.shutdown_init_context()
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT, dist_init_required=None)
    merge_tp_model_init_into_config(config, mpu, None, dist)  # nothing unless deepspeed.tp_model_init ran
    config_class = DeepSpeedConfig(config, mpu, mesh_device=None)
    deepspeed.set_optimizer_flags(config_class, model)
    engine = DominoDeepSpeedEngine(args=None, model=model, optimizer=optimizer, model_parameters=None,
                                   training_data=None, lr_scheduler=None, mpu=mpu, dist_init_required=None,
                                   collate_fn=None, config=config, mesh_device=None, config_class=config_class)
    zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine
