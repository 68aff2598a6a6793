"""The rules of a parallel layout: which TP x PP x DP grids a world can hold and what a pipeline needs.

Called by :func:`domino.config.validate.validate` (with the world size when it is known) and by the process groups
(:mod:`domino.runtime.state`), so each rule is written once.
"""

from __future__ import annotations

from typing import List, Optional

from domino.config.errors import ConfigError
from domino.config.pipeline_schedule import layer_split_problems, microbatch_problems
from domino.config.schema import DominoConfig


def check_tensor_parallel_size(world_size: int, tensor_model_parallel_size: int,
                               pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1) -> None:
    """Raises :class:`ConfigError` unless ``tensor_model_parallel_size`` x ``context_parallel_size`` x
    ``pipeline_model_parallel_size`` (each >= 1) divides ``world_size``: the one place this rule is written (the
    config, the process groups and evaluation's start-up all call it)."""
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if tp < 1 or world_size % tp != 0:
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}")
    if pp < 1 or world_size % (tp * pp) != 0:
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp}")
    if cp < 1 or world_size % (tp * pp * cp) != 0:
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}")


def data_parallel_size(config: DominoConfig, world_size: int) -> int:
    """Number of data-parallel replicas for ``world_size`` processes (context-parallel ranks share a replica's
    samples: they split its sequences)."""
    p = config.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)


def zero_reduces_in_backward(config: DominoConfig) -> bool:
    """Whether domino asks DeepSpeed's ZeRO optimizer to reduce each gradient bucket during backward
    (``overlap_comm`` and ``contiguous_gradients``, ``domino.optim.deepspeed_config.zero_optimization``); its step then
    all-gathers the updated weights. Both make ZeRO hook every gradient and reduce it inside backward (deepspeed
    0.19.8 ``stage_1_and_2.py``, ``create_gradient_handling_hooks``), so neither with a pipeline (there after every
    micro-batch of the schedule: without them ZeRO leaves ``.grad`` alone until the step, whose DP mean it
    takes into its partitions without reducing again, ``domino.optim.zero_step.take_reduced_gradients``) nor
    with recomputed Domino chunks (each chunk's backward delivers a weight's gradient once more, and a hook
    reducing on arrival refuses the second: "Gradient computed twice for this partition", ``reduce_ipg_grads``)."""
    recomputed_chunks = config.train.recompute_granularity == "full" and (config.parallel.domino_chunks or 1) > 1
    return config.parallel.pipeline_model_parallel_size <= 1 and not recomputed_chunks


def virtual_stages(config: DominoConfig) -> int:
    """Model chunks per pipeline stage: ``--virtual-pipeline-model-parallel-size``, 1 when not given."""
    v = config.parallel.virtual_pipeline_model_parallel_size
    return 1 if v is None else v


#: Megatron's other spelling of the chunk count, as layers per chunk (``megatron/training/arguments.py``).
LAYERS_PER_VIRTUAL_STAGE_FLAG = "--num-layers-per-virtual-pipeline-stage"


def virtual_stages_from_layers(config: DominoConfig, layers_per_virtual_stage: int, chunks_given: bool) -> int:
    """The chunk count ``--num-layers-per-virtual-pipeline-stage N`` means: ``num_layers / PP / N``, by Megatron's
    rules (NVIDIA/Megatron-LM ``megatron/training/arguments.py`` ``validate_args`` at d98e8a64: the layers divide
    by PP, the layers per stage by N, and at most one of it and ``--num-virtual-stages-per-pipeline-rank``, here
    also spelt ``--virtual-pipeline-model-parallel-size``, is given).

    Raises:
        ConfigError: one line naming the flag and the rule broken.
    """
    layers, pp, n = config.model.num_layers, config.parallel.pipeline_model_parallel_size, layers_per_virtual_stage
    flag = f"{LAYERS_PER_VIRTUAL_STAGE_FLAG} {n}"
    if chunks_given:
        raise ConfigError(f"{flag} and --virtual-pipeline-model-parallel-size (--num-virtual-stages-per-pipeline-"
                          "rank) are mutually exclusive: give one")
    if n < 1:
        raise ConfigError(f"{flag}: must be >= 1")
    if pp < 1 or layers % pp or (layers // pp) % n:
        raise ConfigError(f"{flag}: --num-layers {layers} / --pipeline-model-parallel-size {pp} is not a whole "
                          f"number of stages of {n}-layer chunks")
    return layers // pp // n


def ramps_batch_size(config: DominoConfig) -> bool:
    """Whether the global batch grows during the run (--rampup-batch-size or --step-batch-size-schedule): each
    batch it reaches is then checked with its schedule (:func:`domino.config.batch_schedule.batch_schedule_problems`),
    the fixed one here (:func:`pipeline_problems`)."""
    t = config.train
    return t.rampup_batch_size is not None or t.step_batch_size_schedule is not None


def pipeline_problems(config: DominoConfig, world_size: Optional[int] = None) -> List[str]:
    """What a run with ``--pipeline-model-parallel-size`` > 1 cannot do, one message each (none at one stage).

    ``world_size`` (when known) enables the micro-batch count check: torch's 1F1B schedule needs at least one
    micro-batch per stage (``Schedule1F1B.__init__``, torch 2.13 ``torch/distributed/pipelining/schedules.py``);
    the interleaved schedule a multiple of the stages (Megatron's rule, stricter than torch's
    ``ScheduleInterleaved1F1B``: :func:`~domino.config.pipeline_schedule.microbatch_problems`).
    """
    p, m, t = config.parallel, config.model, config.train
    pp, v = p.pipeline_model_parallel_size, virtual_stages(config)
    if pp <= 1 and v == 1:
        return []
    problems = layer_split_problems(m.num_layers, pp, v)
    if pp <= 1:
        return problems
    if p.zero_stage == 2:
        # DeepSpeed's own pipeline engine refuses it too (deepspeed 0.19.8 runtime/pipe/engine.py: "ZeRO-2 and
        # ZeRO-3 are incompatible with pipeline parallelism"): ZeRO-2 reduces each gradient in a backward hook
        # of DeepSpeed's backward, and the pipeline schedule runs the backward itself.
        problems.append(f"--zero-stage 2 with --pipeline-model-parallel-size {pp}: not supported (ZeRO-2 reduces "
                        "gradients inside DeepSpeed's backward, the pipeline schedule runs its own; "
                        "use --zero-stage 1)")
    fixed_batch = not ramps_batch_size(config)
    if world_size is not None and world_size % (p.tensor_model_parallel_size * pp) == 0 and fixed_batch:
        dp = data_parallel_size(config, world_size)
        global_batch = t.global_batch_size or t.micro_batch_size * dp
        micro_batches = global_batch // (t.micro_batch_size * dp)
        if micro_batches < pp:
            problems.append(f"--global-batch-size {global_batch} gives {micro_batches} micro-batches of "
                            f"--micro-batch-size {t.micro_batch_size} per data-parallel rank (DP {dp}), fewer than "
                            f"--pipeline-model-parallel-size {pp} (the 1F1B schedule needs one per stage)")
        else:
            problems += [f"--global-batch-size {global_batch}: {problem}"
                         for problem in microbatch_problems(micro_batches, pp, v)]
    return problems


#: How context-parallel attention may communicate: ``p2p`` (:mod:`domino.parallel.ring_attention`) and ``a2a``
#: (:mod:`domino.parallel.all_to_all_attention`); Megatron's others (``allgather``, hierarchical ``a2a+p2p``:
#: ``--cp-comm-type`` in megatron/training/arguments.py, d98e8a64) are not offered.
CP_COMM_TYPES = ("p2p", "a2a")


def context_parallel_problems(config: DominoConfig) -> List[str]:
    """What a run with ``--context-parallel-size`` > 1 cannot do, one message each (none at CP 1).

    The sequence must cut into ``2 x CP`` equal chunks (Megatron's rule: ``get_batch_on_this_cp_rank`` in
    megatron/training/utils.py views it as ``2 * cp_size`` chunks). Both exchanges take per-document masks and
    attention dropout; ``a2a`` splits every TP rank's query and key/value heads over the CP ranks, so both counts
    must divide.
    """
    p, m = config.parallel, config.model
    cp = p.context_parallel_size
    problems = [] if p.cp_comm_type in CP_COMM_TYPES else [
        f"--cp-comm-type {p.cp_comm_type}: must be one of {', '.join(CP_COMM_TYPES)}"]
    if cp < 1:
        return problems + [f"--context-parallel-size must be >= 1, got {cp}"]
    if cp == 1:
        return problems
    flag = f"--context-parallel-size {cp}"
    if m.seq_length % (2 * cp):
        problems.append(f"--seq-length {m.seq_length} is not divisible by 2 x {flag} (each rank holds two of "
                        f"{2 * cp} equal chunks)")
    if p.cp_comm_type == "a2a":
        tp = p.tensor_model_parallel_size
        heads, groups = m.num_attention_heads // tp, m.query_groups // tp
        if heads % cp or groups % cp:
            problems.append(f"--cp-comm-type a2a with {flag}: the {heads} query and {groups} key/value heads of each "
                            f"TP rank (--num-attention-heads, --num-query-groups / --tensor-model-parallel-size {tp}) "
                            f"must both be divisible by {cp}; use --cp-comm-type p2p")
    return problems
