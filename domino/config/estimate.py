"""``domino estimate``: memory per GPU and step time of a layout, and the layouts that fit, best first.

The closed forms of each part (weights, gradients, optimizer state, activations, logits, buffers, DeepSpeed's own
allocations) are in :mod:`domino.config.memory_formulas`, the pipeline schedule's arithmetic in
:mod:`domino.config.pipeline_schedule`. This module adds them up for each pipeline stage of a layout:

* **what a stage holds**: ``L/p`` layers (``v`` chunks of ``L/(p v)`` with the interleaved schedule); the first
  stage the embedding, the last the final norm and the output layer. With tied embeddings and ``p > 1`` the last
  stage holds its own copy of the word embedding as the output weight, kept equal to the first stage's by an
  all-reduce of their gradients (Megatron-LM ``LanguageModule.setup_embeddings_and_output_layer``,
  ``megatron/core/models/common/language_module/language_module.py``, core_r0.11.0 commit 7c00175e; the output
  layer allocates that weight on every stage but the first, ``skip_weight_param_allocation`` in
  ``megatron/core/models/gpt/gpt_model.py``): counted with its gradient and optimizer state on both stages.
* **activations**: ``c`` micro-batch chunks in flight on the stage (:func:`~domino.config.pipeline_schedule.
  in_flight_microbatches`) keep what they store for backward; the one being back-propagated peaks with its
  recomputed block: ``(c - 1) stored + peak`` of one chunk. The embedding's mask counts on the first stage for
  each micro-batch in flight, the final norm and the logits on the last stage for one (its forward is followed by
  that micro-batch's backward).
* **the peak**: weights, optimizer state, buffers, DeepSpeed's buffers and the larger of the logits and one layer's
  context-parallel attention at work (the two are never alive together), plus the largest of (the
  activations at their peak and the gradients backward makes first), (all gradients and the activations alive
  at the stage's second backward, :func:`~domino.config.pipeline_schedule.chunks_beside_gradients`: gradients
  accumulate over a step's micro-batches, so every backward but the first runs beside them; with one micro-batch
  and one stage there is no second) and, for a pipelined step with DP > 1, (all gradients twice: domino averages
  them over the replicas through one flat copy, ``domino/train/pipeline_step.py``). A GPU's figure is its stage's; the layout's is the largest stage's, and
  ``fits`` reads that one.
* **step time**: training FLOPs per token x tokens per step / (GPUs x peak TFLOP/s x MFU), the MFU being that of
  the busy time, plus the pipeline bubble and the communication the layout exposes on a link model
  (:mod:`domino.config.step_time`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from domino.config import pipeline_schedule as schedule
from domino.config.deepspeed_memory import VALIDATION, fp32_gradient_bytes
from domino.config.layout import virtual_stages, zero_reduces_in_backward
from domino.config.memory_formulas import (
    DEVICES, RECOMPUTE_CHOICES, Layout, ModelShape, attention_transient_bytes, context_parallel_bytes_per_layer,
    embedding_activation_bytes, final_norm_activation_bytes, layer_activation_bytes, logits_bytes,
    model_flops_per_token, parameter_counts, rng_record_bytes,
)
from domino.config.schema import DominoConfig
from domino.config.estimate_text import GB, describe, describe_pipeline
from domino.config.step_time import LinkModel, StepTime, step_time, step_traffic
from domino.config.validate import ConfigError, padded_vocab_size, resolve_domino_chunks, validate, zero_stage_for

__all__ = ["DEVICES", "Estimate", "Layout", "USABLE_FRACTION", "candidate_layouts", "describe", "describe_pipeline",
           "estimate_layout", "fitting_layouts", "layout_of"]

#: Vocabulary assumed when neither --vocab-size nor a tokenizer says (the GPT-2 BPE, domino's default tokenizer).
DEFAULT_VOCAB = 50257
#: Share of a GPU's memory a layout may plan for: the rest is the CUDA context, NCCL and allocator fragmentation.
USABLE_FRACTION = 0.9
#: DeepSpeed bucket sizes (elements) domino configures (``deepspeed_config`` in domino/optim/deepspeed_config.py).
ZERO_BUCKET_ELEMENTS = 5e7
#: Pipeline sizes the layout search tries (each must also divide --num-layers, domino.config.validate).
PIPELINE_SIZES = (1, 2, 4, 8, 16)


@dataclass
class Estimate:
    """Memory per GPU (bytes) and time of one layout: the figures of its fullest pipeline stage."""

    layout: Layout
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    flops_per_token: float
    fp32_grads: float = 0.0
    attention: float = 0.0
    """One layer's context-parallel attention at work beyond what it saves (the ring's key/value and gradient
    buffers, one block's scores, the all-to-all's exchange buffers:
    :func:`~domino.config.memory_formulas.attention_transient_bytes`); 0 at CP 1."""
    timing: Optional[StepTime] = None
    """Compute, bubble and communication of a step (None without a peak TFLOP/s): :mod:`domino.config.step_time`."""
    gpu_memory_gb: Optional[float] = None
    parameters: int = 0
    first_gradients: float = 0.0
    activations_beside_gradients: float = 0.0
    """Activations alive at the stage's second backward, beside the first one's gradients (0: a single backward)."""
    step_gradient_copy: float = 0.0
    """Another copy of the gradients at the optimizer step, after the activations are gone: the flat data-parallel
    all-reduce of a pipelined step (``domino.train.pipeline_step.average_over_data_parallel``), with DP > 1."""
    stage: int = 0
    """The pipeline rank whose figures these are (the one that needs the most memory)."""
    stage_totals: List[float] = field(default_factory=list)
    """:attr:`total` of every pipeline stage, first to last."""
    num_microbatches: int = 1
    """Micro-batches per step: global batch / (micro-batch x data-parallel size)."""
    bubble_fraction: float = 0.0
    """Share of the step each stage idles (pipeline_schedule.bubble_fraction)."""
    p2p_bytes_per_step: float = 0.0
    """Bytes the busiest stage sends to its pipeline neighbours per step."""
    cp_bytes_per_step: float = 0.0
    """Bytes a rank of the busiest stage sends for context-parallel attention per step (0 at CP 1)."""
    forward_passes_per_token: float = 0.0
    """What a token costs in time, in forward passes: 3 (forward and backward), more with recompute, over 1 - the
    pipeline bubble (the same at every TP size, whose vocabulary padding changes the FLOPs a little)."""

    @property
    def total(self) -> float:
        """The peak, bytes (see the module doc)."""
        overlapping = max(self.activations + self.first_gradients,
                          self.activations_beside_gradients + self.gradients, self.gradients + self.step_gradient_copy)
        # Attention runs before the loss makes the logits (forward) and after its backward freed them: the larger.
        transient = max(self.logits, self.attention)
        return self.weights + self.optimizer + transient + self.buffers + self.fp32_grads + overlapping

    @property
    def step_time_s(self) -> Optional[float]:
        """Compute at the stated MFU, the pipeline bubble and the communication the layout exposes, seconds."""
        return self.timing.step_time_s if self.timing else None

    @property
    def exposed_communication_s(self) -> Optional[float]:
        """Link time the step waits for, seconds."""
        return self.timing.exposed_communication_s if self.timing else None

    @property
    def fits(self) -> bool:
        """Whether the total stays within the usable share of the GPU (True when no GPU size was given)."""
        return self.gpu_memory_gb is None or self.total <= USABLE_FRACTION * self.gpu_memory_gb * GB

    def memory_gb(self) -> Dict[str, float]:
        """The parts in GiB, rounded for printing."""
        parts = ("weights", "gradients", "optimizer", "activations", "attention", "logits", "buffers", "fp32_grads",
                 "total")
        return {p: round(getattr(self, p) / GB, 3) for p in parts}

    def to_json(self) -> Dict[str, object]:
        """The ``--json`` form: fits, the layout, memory per GPU in GiB, FLOPs, time and the pipeline's figures."""
        return {"fits": self.fits, "layout": dataclasses.asdict(self.layout), "memory_gb_per_gpu": self.memory_gb(),
                "gpu_memory_gb": self.gpu_memory_gb, "usable_fraction": USABLE_FRACTION,
                "parameters": self.parameters, "flops_per_token": self.flops_per_token,
                "step_time_s": self.step_time_s, "exposed_communication_s": self.exposed_communication_s,
                "time": self.timing.to_json() if self.timing else None, "validation": VALIDATION,
                "pipeline": {"stage_of_the_figures": self.stage,
                             "total_gb_per_stage": [round(t / GB, 3) for t in self.stage_totals],
                             "num_microbatches": self.num_microbatches, "bubble_fraction": self.bubble_fraction,
                             "p2p_gb_per_step": round(self.p2p_bytes_per_step / GB, 4)},
                "context_parallel_gb_per_step": round(self.cp_bytes_per_step / GB, 4)}


def num_microbatches(config: DominoConfig, layout: Layout) -> int:
    """Micro-batches per step of ``layout``: the global batch (default: one micro-batch per replica) over
    micro-batch x data-parallel size."""
    per_pass = layout.micro_batch_size * layout.data_parallel_size
    return max(1, (config.train.global_batch_size or per_pass) // per_pass)


def message_bytes(shape: ModelShape, layout: Layout, act_bytes: int) -> float:
    """One micro-batch's activation between two stages, per TP rank: ``[s, b, h]``, ``[s/t, b, h]`` with SP."""
    sp = layout.tensor_model_parallel_size if layout.sequence_parallel else 1
    return shape.s * layout.micro_batch_size * shape.h / sp * act_bytes


def pipeline_buffer_bytes(shape: ModelShape, layout: Layout, act_bytes: int, rank: int, microbatches: int) -> float:
    """What torch's ``PipelineStage`` keeps besides the model's own tensors (torch 2.13
    ``torch/distributed/pipelining/stage.py``): a receive buffer per micro-batch (and model chunk) of the step for
    the activations on every stage but the first (``_setup_forward_recv_info``) and for their gradients on every
    stage but the last (``_create_grad_recv_info``), and, on every stage but the last, each micro-batch's output
    kept in ``fwd_cache`` until its backward."""
    p, v = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    first, last = rank == 0, rank == p - 1
    receives = 2 * v * microbatches - (microbatches if first else 0) - (microbatches if last else 0)
    outputs = 0 if last else schedule.in_flight_chunks(rank, p, microbatches, v)
    return (receives + outputs) * message_bytes(shape, layout, act_bytes)


def _stage(config: DominoConfig, layout: Layout, shape: ModelShape, rank: int, microbatches: int,
           device: str) -> Dict[str, float]:
    """The memory parts (bytes) of pipeline rank ``rank``; see the module doc."""
    t, p, v = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, \
        layout.virtual_pipeline_model_parallel_size
    first, last = rank == 0, rank == p - 1
    half = config.train.bf16 or config.train.fp16
    act = 2 if half else 4
    weight_b, grad_b, optim_b = (2, 2, 12) if half else (4, 4, 8)
    dp = layout.data_parallel_size
    counts = parameter_counts(shape, t)
    layers = shape.L // p
    output = counts["output"] or (counts["vocab_matrix"] if p > 1 else 0)  # untied, or the tied copy at p > 1
    params = (layers * counts["layer"] + (counts["embedding"] if first else 0)
              + (counts["final_norm"] + output if last else 0))
    zero2 = dp if layout.zero_stage >= 2 else 1
    gradients = params * grad_b / zero2
    made_first = (counts["vocab_matrix"] if last else counts["layer"]) * grad_b / zero2
    # The ZeRO optimizer's two reduction buckets (overlap_comm); bf16 ZeRO 1's BF16_Optimizer has none.
    zero_optimizer = layout.zero_stage >= 1 and not (config.train.bf16 and layout.zero_stage == 1)
    buckets = 2 * ZERO_BUCKET_ELEMENTS * grad_b if zero_optimizer and dp > 1 else 0.0
    qkv_copies = layers * shape.h * shape.qkv_width / t * act
    p2p = pipeline_buffer_bytes(shape, layout, act, rank, microbatches) if p > 1 else 0.0
    chunk = dataclasses.replace(shape, L=layers // v)
    stored, peak = layer_activation_bytes(chunk, layout, act, device, config.parallel.cp_comm_type)
    in_flight = schedule.in_flight_chunks(rank, p, microbatches, v)
    beside = schedule.chunks_beside_gradients(rank, p, microbatches, v)
    embedding = embedding_activation_bytes(shape, layout, act, device) if first else 0.0
    final = final_norm_activation_bytes(shape, layout, act) if last else 0.0

    def alive(chunks: int) -> float:  # ``chunks`` in flight, the last of them back-propagated
        return (chunks - 1) * stored + peak + embedding * chunks / v + final

    fp32_grads = fp32_gradient_bytes(params, dp, layout.zero_stage, bool(config.train.bf16),
                                     bool(config.train.fp16))
    return dict(weights=params * weight_b, gradients=gradients, optimizer=params * optim_b / (
        dp if layout.zero_stage >= 1 else 1), fp32_grads=sum(fp32_grads.values()),
        activations=alive(in_flight), activations_beside_gradients=alive(beside) if beside else 0.0,
        logits=logits_bytes(shape, layout, act, device) if last else 0.0,
        attention=attention_transient_bytes(shape, layout, config.parallel.cp_comm_type, act, device),
        buffers=buckets + qkv_copies + rng_record_bytes(layers, layout) + p2p,
        step_gradient_copy=params * grad_b if p > 1 and dp > 1 else 0.0,
        first_gradients=min(gradients, made_first))


def estimate_layout(config: DominoConfig, layout: Layout, vocab: Optional[int] = None,
                    gpu_memory_gb: Optional[float] = None, mfu: float = 0.4, peak_tflops: Optional[float] = None,
                    device: str = "gpu", link: Optional[LinkModel] = None) -> Estimate:
    """Memory per GPU and step time of ``config``'s model trained with ``layout``.

    Args:
        config: the run (model shape, precision, global batch); its own parallel settings are ignored.
        layout: the layout to estimate.
        vocab: vocabulary before padding (default: ``--vocab-size``, else the GPT-2 BPE's 50257).
        gpu_memory_gb: memory of one GPU, for ``fits``.
        mfu: model FLOPs utilisation of the busy time, for the step time.
        peak_tflops: peak TFLOP/s of one GPU (None: no step time).
        device: gpu or cpu: the kernels torch picks there differ in what they save
            (:func:`domino.config.memory_formulas.layer_activation_bytes`).
        link: the links for the step's communication (default: :class:`~domino.config.step_time.LinkModel`'s
            H100 NVLink within 8-GPU nodes, 400 Gb/s InfiniBand between them).

    Raises:
        ValueError: when ``layout``'s pipeline cannot split the layers or schedule the micro-batches
            (:func:`~domino.config.pipeline_schedule.layer_split_problems`, ``microbatch_problems``).
    """
    padded = padded_vocab_size(vocab or config.model.vocab_size or DEFAULT_VOCAB,
                               config.replace(tensor_model_parallel_size=layout.tensor_model_parallel_size))
    shape = ModelShape.of(config.model, padded)
    # Context parallelism: every activation holds this rank's seq / CP tokens (the FLOPs stay the whole sequence's).
    local = dataclasses.replace(shape, s=shape.s // layout.context_parallel_size)
    p, v = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    m = num_microbatches(config, layout)
    problems = schedule.layer_split_problems(shape.L, p, v) + schedule.microbatch_problems(m, p, v)
    if problems:  # a pipeline Megatron refuses to build or to schedule
        raise ValueError("; ".join(problems))
    stages = [Estimate(layout=layout, flops_per_token=0.0, gpu_memory_gb=gpu_memory_gb,
                       **_stage(config, layout, local, rank, m, device)) for rank in range(p)]
    worst = max(range(p), key=lambda rank: stages[rank].total)
    flops = model_flops_per_token(shape)
    passes = 4 if layout.recompute == "full" else 3
    train_flops = passes * flops
    if layout.recompute == "selective":  # the attention core runs forward once more
        train_flops += shape.L * 4 * shape.s * shape.h
    bubble = schedule.bubble_fraction(p, m, v)
    act = 2 if config.train.bf16 or config.train.fp16 else 4
    message = message_bytes(local, layout, act)
    p2p = max(schedule.p2p_bytes_per_step(rank, p, m, message, v) for rank in range(p))
    layers = shape.L // p  # every stage's (layer_split_problems refused an uneven split above)
    cp_bytes = layers * m * context_parallel_bytes_per_layer(local, layout, config.parallel.cp_comm_type, act)
    timing = None
    if peak_tflops:
        gpus = layout.tensor_model_parallel_size * p * layout.data_parallel_size * layout.context_parallel_size
        flop_s = gpus * peak_tflops * 1e12 * mfu
        compute = m * layout.data_parallel_size * layout.micro_batch_size * shape.s * train_flops / flop_s
        weight_bytes = 2 if config.train.bf16 or config.train.fp16 else 4
        zero_optimizer = layout.zero_stage >= 1 and not (config.train.bf16 and layout.zero_stage == 1)
        asked = config_with_layout(config, layout).replace(domino_chunks=layout.domino_chunks)
        in_backward = zero_optimizer and zero_reduces_in_backward(asked)
        traffic = step_traffic(local, layout, m, act, stages[worst].weights / weight_bytes, cp_bytes,
                               config.parallel.cp_comm_type, in_backward, compute, flop_s / gpus)
        timing = step_time(traffic, compute, compute * bubble / (1 - bubble), layout, link or LinkModel())
    return dataclasses.replace(
        stages[worst], flops_per_token=3 * flops, timing=timing, stage=worst,
        forward_passes_per_token=train_flops / flops / (1 - bubble),
        parameters=int(parameter_counts(shape, 1)["total"]), stage_totals=[s.total for s in stages],
        num_microbatches=m, bubble_fraction=bubble, p2p_bytes_per_step=p2p, cp_bytes_per_step=cp_bytes)


def layout_of(config: DominoConfig, gpus: int) -> Layout:
    """The layout ``config`` asks for on ``gpus`` GPUs (its TP, PP, CP, ZeRO, micro-batch, recompute and SP flags)."""
    p, t = config.parallel, config.train
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if t.recompute_granularity == "full":
        recompute = "full"
    elif t.recompute_activations or t.recompute_granularity == "selective":
        recompute = "selective"
    else:
        recompute = "none"
    dp = max(1, gpus // (tp * pp * cp))
    return Layout(context_parallel_size=cp, tensor_model_parallel_size=tp, data_parallel_size=dp, zero_stage=zero_stage_for(config, dp),
                  micro_batch_size=t.micro_batch_size, recompute=recompute,
                  recompute_method=t.recompute_method or "uniform", recompute_num_layers=t.recompute_num_layers or 1,
                  sequence_parallel=p.sequence_parallel and tp > 1, domino_chunks=p.domino_chunks or 1,
                  pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual_stages(config))


def config_with_layout(config: DominoConfig, layout: Layout) -> DominoConfig:
    """A copy of ``config`` that asks for ``layout`` (the inverse of :func:`layout_of`), Domino's chunks left to
    domino's default for that TP size and micro-batch (:func:`domino.config.validate.resolve_domino_chunks`)."""
    full = layout.recompute == "full"
    return resolve_domino_chunks(config.replace(
        tensor_model_parallel_size=layout.tensor_model_parallel_size, zero_stage=layout.zero_stage,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        sequence_parallel=layout.sequence_parallel, domino_chunks=None, micro_batch_size=layout.micro_batch_size,
        recompute_activations=False, recompute_granularity=None if layout.recompute == "none" else layout.recompute,
        recompute_method=layout.recompute_method if full else None,
        recompute_num_layers=layout.recompute_num_layers if full else None))[0]


def candidate_layouts(config: DominoConfig, gpus: int) -> List[Layout]:
    """Every layout worth trying on ``gpus`` GPUs that ``config``'s model can run: TP within one 8-GPU node, PP
    (:data:`PIPELINE_SIZES`; 1F1B, and the interleaved schedule at the config's chunk count when it asks for
    one), ZeRO 0-2, micro-batch 1..the config's (powers of two), no/selective/full recompute,
    SP on or off at TP > 1, CP 1-8 (tried only where the config's sequence and masks allow it), each kept only when the config asking for it passes
    :func:`domino.config.validate.validate` (the layout rules live there alone: TP x PP dividing the GPUs; TP
    dividing heads, query groups, MLP and, with SP, the sequence; PP dividing the layers; the global batch; ZeRO
    with recomputed chunks)."""
    micro, micros = 1, []
    while micro <= max(1, config.train.micro_batch_size):
        micros.append(micro)
        micro *= 2
    out = []
    chunk_counts = sorted({1, virtual_stages(config)})  # the interleaved schedule where the config asks for it
    sizes = (1, 2, 4, 8)
    for tp, pp, v, zero, mb, recompute, sp, cp in itertools.product(
            sizes, PIPELINE_SIZES, chunk_counts, (0, 1, 2), micros, RECOMPUTE_CHOICES, (False, True), sizes):
        if tp * pp * cp > gpus or (sp and tp == 1):
            continue
        layout = Layout(tp, max(1, gpus // (tp * pp * cp)), zero, mb, recompute, sequence_parallel=sp,
                        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=v,
                        context_parallel_size=cp)
        candidate = config_with_layout(config, layout)
        try:
            validate(candidate, world_size=gpus)
        except ConfigError:
            continue
        layout.domino_chunks = candidate.parallel.domino_chunks
        out.append(layout)
    return out


def rank_key(estimate: Estimate) -> tuple:
    """Best first: fits; the shortest step (:attr:`Estimate.step_time_s`: compute with recompute's extra passes,
    the pipeline bubble and the communication the layout exposes; without a peak TFLOP/s, the modelled passes per
    token); then fewest ranks splitting one sample (TP x CP), the smaller CP, the smaller TP; no SP; largest
    micro-batch (fuller GEMMs); lowest ZeRO stage; then the least memory."""
    lay = estimate.layout
    tp, cp = lay.tensor_model_parallel_size, lay.context_parallel_size
    time = estimate.step_time_s if estimate.step_time_s is not None else estimate.forward_passes_per_token
    return (not estimate.fits, round(time, 6), tp * cp, cp, tp, lay.sequence_parallel, -lay.micro_batch_size,
            lay.zero_stage, estimate.total)


def fitting_layouts(config: DominoConfig, gpus: int, gpu_memory_gb: float, **kwargs) -> List[Estimate]:
    """The candidate layouts that fit ``gpu_memory_gb``, best first (:func:`rank_key`)."""
    estimates = [estimate_layout(config, lay, gpu_memory_gb=gpu_memory_gb, **kwargs)
                 for lay in candidate_layouts(config, gpus)]
    return sorted((e for e in estimates if e.fits), key=rank_key)
