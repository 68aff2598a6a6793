"""The DeepSpeed config derived from domino's flags, and the step-shape choices it rests on (accumulation steps,
the ZeRO stage, who clips)."""

from __future__ import annotations

import json
import math
from typing import Any, Dict


from domino.config import ConfigError, DominoConfig
from domino.config.layout import zero_reduces_in_backward
from domino.config.validate import zero_stage_for


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




def clips_itself(config: DominoConfig, dp: int) -> bool:
    """Whether domino (not DeepSpeed) clips gradients: plain fp32 data parallelism (ZeRO stage 0), and every
    pipelined run (DeepSpeed's norm would sum over one stage only)."""
    return pipelined(config) or (zero_stage(config, dp) == 0 and not (config.train.fp16 or config.train.bf16))










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



