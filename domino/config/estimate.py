"""Per-GPU memory and step time of a run, before launch: the formulas behind ``domino estimate``.

Memory per GPU is the sum of six parts, each a closed form in the architecture fields and the layout:

* **weights, gradients, optimizer state**: the ZeRO paper's accounting (Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", section 3.1 and figure 1): mixed precision keeps 2
  bytes of weights and 2 of gradients per parameter and 12 of Adam state (fp32 master, momentum, variance); fp32
  training 4 + 4 + 8. ZeRO 1 divides the optimizer state by the data-parallel size, ZeRO 2 the gradients too.
  Tensor parallelism divides the sharded matrices, not the replicated norms, biases and position embeddings.
* **activations**: the tensors saved for backward, listed per layer as in Korthikanti et al. 2022 ("Reducing
  Activation Recomputation in Large Transformer Models", section 4.1, table 2): ``34 s b h + 5 a s^2 b`` bytes per
  layer in 16-bit, where 34 = LayerNorm inputs 4, QKV input 2, Q/K/V 6, output-projection input 2, dropout masks
  2, MLP input 2, GeLU input 8, GeLU output 8 (with ffn = 4h). Here each term is an element count times the
  activation's bytes, so SwiGLU (two fc1 outputs), grouped-query attention (fewer K/V columns) and fp32 plug in.
  The ``5 a s^2 b`` attention-score term exists only on the math attention path; torch SDPA's fused kernels
  (FlashAttention on GPUs, and on CPU without attention dropout) save the output and a logsumexp instead.
  Tensor parallelism divides the attention and MLP terms by t (``10 + 24/t`` in the paper); sequence parallelism
  divides the rest too; selective recompute drops the attention core; full recompute keeps only layer inputs
  (Korthikanti's ``2 s b h L``) plus one recomputed unit.
* **logits**: the vocabulary-parallel cross-entropy keeps an fp32 softmax ``[s, b, V/t]`` (plus the 16-bit logits);
  on GPUs one row chunk of it at a time (the chunked loss of ``domino/parallel/chunked_cross_entropy.py``).
* **buffers**: DeepSpeed's ZeRO reduce/all-gather buckets (sizes from ``domino/train/engine.py``), the per-layer
  regrouped QKV weight copy of :mod:`domino.model.qkv_projection` and full recompute's RNG snapshots.
* **deepspeed**: what DeepSpeed's optimizers keep beyond the paper's count (the fp32 gradient buffer of bf16 ZeRO 1,
  fp32 gradient partitions, the engine's flattening all-reduce buffer): :mod:`domino.config.deepspeed_memory`,
  which also says which of these figures have been measured (:data:`VALIDATION`: none on a GPU yet).

FLOPs per token follow Megatron's count (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters", appendix: ``72 B s L h^2 (1 + s/6h + V/12Lh)`` per batch), written per matrix so SwiGLU and GQA
plug in; full recompute adds one more forward (4 instead of 3 passes).

The LLaMA-family fields (``swiglu``, grouped-query attention, ``untie_embeddings_and_output_weights``,
``disable_bias_linear``, rotary positions, ``normalization``) change the counts where they change the tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional

from domino.config.deepspeed_memory import VALIDATION, deepspeed_buffer_bytes
from domino.config.schema import DominoConfig, ModelConfig
from domino.config.validate import ConfigError, padded_vocab_size, resolve_domino_chunks, validate, zero_stage_for

GB = 2**30
#: Vocabulary assumed when neither --vocab-size nor a tokenizer says (the GPT-2 BPE, domino's default tokenizer).
DEFAULT_VOCAB = 50257
#: Share of a GPU's memory a layout may plan for: the rest is the CUDA context, NCCL and allocator fragmentation.
USABLE_FRACTION = 0.9
#: DeepSpeed bucket sizes (elements) domino configures (``deepspeed_config`` in domino/train/engine.py).
ZERO_BUCKET_ELEMENTS = 5e7
RECOMPUTE_CHOICES = ("none", "selective", "full")
DEVICES = ("gpu", "cpu")


@dataclass
class Layout:
    """How one run is spread over GPUs, and which memory levers it pulls."""

    tensor_model_parallel_size: int = 1
    """Processes that split every layer."""
    data_parallel_size: int = 1
    """Model replicas (GPUs / TP)."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage 0, 1 or 2."""
    micro_batch_size: int = 1
    """Samples per GPU per forward/backward pass."""
    recompute: str = "none"
    """Activation recompute: none, selective (the attention core) or full (whole layers)."""
    recompute_method: str = "uniform"
    """With full recompute: uniform (every layer, in groups) or block (only the first --recompute-num-layers)."""
    recompute_num_layers: int = 1
    """With full recompute: layers per checkpointed group (uniform) or checkpointed layers (block)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: the LayerNorm/dropout regions split along the sequence over TP."""
    domino_chunks: int = 1
    """Domino batch chunks: recompute brings back one chunk's activations at a time."""


@dataclass
class Estimate:
    """Memory per GPU (bytes) and time of one layout."""

    layout: Layout
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    flops_per_token: float
    deepspeed: float = 0.0
    step_time_s: Optional[float] = None
    gpu_memory_gb: Optional[float] = None
    parameters: int = 0

    first_gradients: float = 0.0

    @property
    def total(self) -> float:
        """The peak, bytes: weights, optimizer state, logits and buffers, plus the larger of (activations and the
        gradients backward makes first, the output layer's) and all gradients: backward frees each layer's
        activations as it makes that layer's gradients (optimizers set gradients to None after the step)."""
        overlapping = max(self.activations + self.first_gradients, self.gradients)
        return self.weights + self.optimizer + self.logits + self.buffers + self.deepspeed + overlapping

    @property
    def fits(self) -> bool:
        """Whether the total stays within the usable share of the GPU (True when no GPU size was given)."""
        return self.gpu_memory_gb is None or self.total <= USABLE_FRACTION * self.gpu_memory_gb * GB

    def memory_gb(self) -> Dict[str, float]:
        """The parts in GiB, rounded for printing."""
        parts = ("weights", "gradients", "optimizer", "activations", "logits", "buffers", "deepspeed", "total")
        return {p: round(getattr(self, p) / GB, 3) for p in parts}

    def to_json(self) -> Dict[str, object]:
        """The ``--json`` form: fits, the layout, memory per GPU in GiB, FLOPs and time."""
        return {"fits": self.fits, "layout": dataclasses.asdict(self.layout), "memory_gb_per_gpu": self.memory_gb(),
                "gpu_memory_gb": self.gpu_memory_gb, "usable_fraction": USABLE_FRACTION,
                "parameters": self.parameters, "flops_per_token": self.flops_per_token,
                "step_time_s": self.step_time_s, "validation": VALIDATION}


@dataclass
class _Shape:
    """The architecture numbers the formulas read, LLaMA fields with their GPT defaults."""

    L: int
    h: int
    a: int
    f: int
    s: int
    V: int
    positions: int
    kv_fraction: float  # K and V columns relative to Q: 1 for MHA, groups/heads for GQA
    swiglu: bool
    bias: bool
    untied: bool
    norm_params: int  # parameters per norm: 2h for LayerNorm, h for RMSNorm
    hidden_dropout: float
    attention_dropout: float

    @classmethod
    def of(cls, model: ModelConfig, vocab: int) -> "_Shape":
        heads = model.num_attention_heads
        return cls(L=model.num_layers, h=model.hidden_size, a=heads, f=model.ffn_size, s=model.seq_length, V=vocab,
                   positions=0 if model.rope else model.num_positions, kv_fraction=model.query_groups / heads,
                   swiglu=model.swiglu, bias=not model.disable_bias_linear,
                   untied=model.untie_embeddings_and_output_weights,
                   norm_params=model.hidden_size * (1 if model.normalization == "RMSNorm" else 2),
                   hidden_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout)

    @property
    def qkv_width(self) -> float:
        """Output columns of the QKV projection: q (h) plus k and v (h each, fewer with GQA)."""
        return self.h * (1 + 2 * self.kv_fraction)

    @property
    def fc1_width(self) -> int:
        """Output columns of the MLP's first linear: gate and up with SwiGLU."""
        return self.f * (2 if self.swiglu else 1)


def parameter_counts(shape: _Shape, tp: int) -> Dict[str, float]:
    """``{"total": whole model, "per_rank": one TP rank's share}`` (counts of parameters)."""
    h, L = shape.h, shape.L
    sharded_layer = h * shape.qkv_width + h * h + h * shape.fc1_width + shape.f * h
    sharded_bias = (shape.qkv_width + shape.fc1_width) if shape.bias else 0
    replicated_layer = 2 * shape.norm_params + (2 * h if shape.bias else 0)  # norms, row-parallel biases
    vocab = shape.V * h * (2 if shape.untied else 1)
    sharded = L * (sharded_layer + sharded_bias) + vocab
    replicated = L * replicated_layer + shape.norm_params + shape.positions * h
    return {"total": sharded + replicated, "per_rank": sharded / tp + replicated}


def activation_bytes(shape: _Shape, layout: Layout, act_bytes: int, device: str = "gpu") -> float:
    """Bytes saved for backward by one TP rank's layers at the peak (start of backward); see the module doc.

    ``device`` decides two kernel choices of torch: on GPUs dropout keeps a 1-byte mask and SDPA runs a fused
    kernel; on CPUs dropout keeps a noise tensor of the activation's dtype (``is_fused_kernel_acceptable`` in
    pytorch's aten/src/ATen/native/Dropout.cpp is true only for CUDA/XPU/lazy/privateuse1 tensors) and SDPA falls
    back to the math path when attention dropout is on.
    """
    s, b, h, t = shape.s, layout.micro_batch_size, shape.h, layout.tensor_model_parallel_size
    sp = t if layout.sequence_parallel else 1
    sbh = s * b * h
    mask_bytes = 1 if device == "gpu" else act_bytes
    mask = mask_bytes if shape.hidden_dropout > 0 else 0
    # Replicated stream (split by SP): both norms' inputs and outputs (with SP the column-parallel linears keep
    # their input's slice and gather it again in backward), two dropout masks.
    stream = (4 * act_bytes + 2 * mask) * sbh / sp
    # Attention (split by TP): q/k/v, the projection's input; the core's own saved tensors.
    attention = (shape.qkv_width / h + 1) * act_bytes * sbh / t
    if device == "cpu" and shape.attention_dropout > 0:  # math path: Korthikanti's softmax, mask, dropout output
        core = (2 * act_bytes + mask_bytes) * shape.a * s * s * b / t
    else:  # fused SDPA: the output and a fp32 logsumexp per row
        core = act_bytes * sbh / t + 4 * shape.a * s * b / t
    mlp = (shape.fc1_width + shape.f) * s * b * act_bytes / t
    full_layer = stream + attention + core + mlp
    layer_input = act_bytes * sbh / sp
    # Backward peaks where a recomputed block is alive again on top of what is still stored; Domino recomputes
    # one chunk's block at a time.
    chunks = max(1, layout.domino_chunks)
    if layout.recompute == "selective":  # every core dropped; one layer's core alive again at a time
        layers = shape.L * (full_layer - core) + core / chunks
    elif layout.recompute == "full":
        n = max(1, min(layout.recompute_num_layers, shape.L))
        if layout.recompute_method == "block":  # the first n layers keep inputs only, recomputed after the rest
            layers = n * layer_input + max((shape.L - n) * full_layer, full_layer / chunks)
        else:  # uniform: the input of every group of n layers, and one group recomputed at a time
            layers = -(-shape.L // n) * layer_input + n * full_layer / chunks
    else:
        layers = shape.L * full_layer
    # Embedding dropout mask (drawn before the SP split); final norm input (split) and output (gathered).
    return layers + mask * sbh + act_bytes * sbh / sp + act_bytes * sbh


#: Bytes of one RNG snapshot: torch's CPU generator state (5056) for the default and the TP tracker's streams.
RNG_SNAPSHOT_BYTES = 2 * 5056


def rng_record_bytes(num_layers: int, layout: Layout) -> float:
    """RNG snapshots full recompute keeps: one per checkpointed group, or with Domino chunks one before each of
    a layer's 7 steps (``domino.parallel.recompute.run_recorded``), per chunk."""
    if layout.recompute != "full":
        return 0.0
    n = max(1, min(layout.recompute_num_layers, num_layers))
    groups = n if layout.recompute_method == "block" else -(-num_layers // n)
    layers = n if layout.recompute_method == "block" else num_layers
    if layout.domino_chunks > 1:
        return layout.domino_chunks * (6 * layers + groups) * RNG_SNAPSHOT_BYTES
    return groups * RNG_SNAPSHOT_BYTES


#: fp32 logits per chunk of the GPUs' chunked loss (kernels.CUDA_KERNELS.loss_chunk_bytes; a test keeps them equal).
GPU_LOSS_CHUNK_BYTES = 2**30


def logits_bytes(shape: _Shape, layout: Layout, act_bytes: int, device: str = "gpu") -> float:
    """The fp32 softmax of the fused vocabulary-parallel cross-entropy, plus the 16-bit logits it came from; on
    GPUs only one row chunk of them (domino/parallel/chunked_cross_entropy.py) plus, in 16-bit, the output layer's
    fp32 gradient accumulator and one 16-bit chunk product."""
    tokens, columns = shape.s * layout.micro_batch_size, shape.V / layout.tensor_model_parallel_size
    extra = act_bytes if act_bytes != 4 else 0
    rows = tokens if device != "gpu" else min(tokens, max(1, GPU_LOSS_CHUNK_BYTES // (4 * columns)))
    accumulator = columns * shape.h * (4 + act_bytes) if extra and rows < tokens else 0
    return rows * columns * (4 + extra) + accumulator


def model_flops_per_token(shape: _Shape) -> float:
    """Forward FLOPs per token (2 per multiply-add), Megatron's count with the attention square in full."""
    h, s = shape.h, shape.s
    matmuls = h * shape.qkv_width + h * h + h * shape.fc1_width + shape.f * h
    return shape.L * (2 * matmuls + 4 * s * h) + 2 * h * shape.V


def training_flops_per_token(model: ModelConfig, padded_vocab: int) -> float:
    """FLOPs to train on one token without recompute: 3 x :func:`model_flops_per_token` (Megatron's count)."""
    return 3 * model_flops_per_token(_Shape.of(model, padded_vocab))


def estimate_layout(config: DominoConfig, layout: Layout, vocab: Optional[int] = None,
                    gpu_memory_gb: Optional[float] = None, mfu: float = 0.4, peak_tflops: Optional[float] = None,
                    device: str = "gpu") -> Estimate:
    """Memory per GPU and step time of ``config``'s model trained with ``layout``.

    Args:
        config: the run (model shape, precision, global batch); its own parallel settings are ignored.
        layout: the layout to estimate.
        vocab: vocabulary before padding (default: ``--vocab-size``, else the GPT-2 BPE's 50257).
        gpu_memory_gb: memory of one GPU, for ``fits``.
        mfu: model FLOPs utilisation assumed for the step time.
        peak_tflops: peak TFLOP/s of one GPU (None: no step time).
        device: gpu or cpu: the kernels torch picks there differ in what they save (:func:`activation_bytes`).
    """
    padded = padded_vocab_size(vocab or config.model.vocab_size or DEFAULT_VOCAB,
                               dataclasses.replace(config, parallel=dataclasses.replace(
                                   config.parallel, tensor_model_parallel_size=layout.tensor_model_parallel_size)))
    shape = _Shape.of(config.model, padded)
    half = config.train.bf16 or config.train.fp16
    act = 2 if half else 4
    counts = parameter_counts(shape, layout.tensor_model_parallel_size)
    per_rank, dp = counts["per_rank"], layout.data_parallel_size
    weight_b, grad_b, optim_b = (2, 2, 12) if half else (4, 4, 8)
    gradients = per_rank * grad_b / (dp if layout.zero_stage >= 2 else 1)
    optimizer = per_rank * optim_b / (dp if layout.zero_stage >= 1 else 1)
    output_layer = shape.V * shape.h / layout.tensor_model_parallel_size / (dp if layout.zero_stage >= 2 else 1)
    # The ZeRO optimizer's two reduction buckets (overlap_comm); bf16 ZeRO 1's BF16_Optimizer has none.
    zero_optimizer = layout.zero_stage >= 1 and not (config.train.bf16 and layout.zero_stage == 1)
    buckets = 2 * ZERO_BUCKET_ELEMENTS * grad_b if zero_optimizer and dp > 1 else 0.0
    qkv_copies = shape.L * shape.h * shape.qkv_width / layout.tensor_model_parallel_size * act
    buckets += rng_record_bytes(shape.L, layout)
    flops = model_flops_per_token(shape)
    passes = 4 if layout.recompute == "full" else 3
    train_flops = passes * flops
    if layout.recompute == "selective":  # the attention core runs forward once more
        train_flops += shape.L * 4 * shape.s * shape.h
    step = None
    if peak_tflops:
        global_batch = config.train.global_batch_size or layout.micro_batch_size * dp
        gpus = layout.tensor_model_parallel_size * dp
        step = global_batch * shape.s * train_flops / (gpus * peak_tflops * 1e12 * mfu)
    deepspeed = deepspeed_buffer_bytes(per_rank, dp, layout.zero_stage, bool(config.train.bf16),
                                       bool(config.train.fp16))
    return Estimate(layout=layout, weights=per_rank * weight_b, gradients=gradients, optimizer=optimizer,
                    deepspeed=sum(deepspeed.values()),
                    activations=activation_bytes(shape, layout, act, device),
                    logits=logits_bytes(shape, layout, act, device), buffers=buckets + qkv_copies,
                    flops_per_token=3 * flops, step_time_s=step, gpu_memory_gb=gpu_memory_gb,
                    parameters=int(counts["total"]), first_gradients=min(gradients, output_layer * grad_b))


def layout_of(config: DominoConfig, gpus: int) -> Layout:
    """The layout ``config`` asks for on ``gpus`` GPUs (its TP, ZeRO, micro-batch, recompute and SP flags)."""
    p, t = config.parallel, config.train
    tp = p.tensor_model_parallel_size
    if t.recompute_granularity == "full":
        recompute = "full"
    elif t.recompute_activations or t.recompute_granularity == "selective":
        recompute = "selective"
    else:
        recompute = "none"
    dp = max(1, gpus // tp)
    return Layout(tensor_model_parallel_size=tp, data_parallel_size=dp, zero_stage=zero_stage_for(config, dp),
                  micro_batch_size=t.micro_batch_size, recompute=recompute,
                  recompute_method=t.recompute_method or "uniform", recompute_num_layers=t.recompute_num_layers or 1,
                  sequence_parallel=p.sequence_parallel and tp > 1, domino_chunks=p.domino_chunks or 1)


def config_with_layout(config: DominoConfig, layout: Layout) -> DominoConfig:
    """A copy of ``config`` that asks for ``layout`` (the inverse of :func:`layout_of`), Domino's chunks left to
    domino's default for that TP size and micro-batch (:func:`domino.config.validate.resolve_domino_chunks`)."""
    out = copy.deepcopy(config)
    p, t = out.parallel, out.train
    p.tensor_model_parallel_size, p.zero_stage = layout.tensor_model_parallel_size, layout.zero_stage
    p.sequence_parallel, p.domino_chunks = layout.sequence_parallel, None
    t.micro_batch_size = layout.micro_batch_size
    t.recompute_activations = False
    t.recompute_granularity = None if layout.recompute == "none" else layout.recompute
    full = layout.recompute == "full"
    t.recompute_method = layout.recompute_method if full else None
    t.recompute_num_layers = layout.recompute_num_layers if full else None
    resolve_domino_chunks(out)
    return out


def candidate_layouts(config: DominoConfig, gpus: int) -> List[Layout]:
    """Every layout worth trying on ``gpus`` GPUs that ``config``'s model can run: TP within one 8-GPU node, ZeRO
    0-2, micro-batch 1..the config's (powers of two), no/selective/full recompute, SP on or off at TP > 1, each
    kept only when the config asking for it passes :func:`domino.config.validate.validate` (the layout rules
    live there alone: TP dividing the GPUs, heads, query groups, MLP and, with SP, the sequence; the global
    batch; ZeRO with recomputed chunks)."""
    micro, micros = 1, []
    while micro <= max(1, config.train.micro_batch_size):
        micros.append(micro)
        micro *= 2
    out = []
    for tp, zero, mb, recompute, sp in itertools.product((1, 2, 4, 8), (0, 1, 2), micros, RECOMPUTE_CHOICES,
                                                         (False, True)):
        if tp > gpus or (sp and tp == 1):
            continue
        layout = Layout(tp, max(1, gpus // tp), zero, mb, recompute, sequence_parallel=sp)
        candidate = config_with_layout(config, layout)
        try:
            validate(candidate, world_size=gpus)
        except ConfigError:
            continue
        layout.domino_chunks = candidate.parallel.domino_chunks
        out.append(layout)
    return out


def rank_key(estimate: Estimate) -> tuple:
    """Best first: fits; least recompute (fewest FLOPs); smallest TP (least communication); no SP; largest
    micro-batch (fuller GEMMs); lowest ZeRO stage (least communication); then the least memory."""
    lay = estimate.layout
    return (not estimate.fits, RECOMPUTE_CHOICES.index(lay.recompute), lay.tensor_model_parallel_size,
            lay.sequence_parallel, -lay.micro_batch_size, lay.zero_stage, estimate.total)


def fitting_layouts(config: DominoConfig, gpus: int, gpu_memory_gb: float, **kwargs) -> List[Estimate]:
    """The candidate layouts that fit ``gpu_memory_gb``, best first (:func:`rank_key`)."""
    estimates = [estimate_layout(config, lay, gpu_memory_gb=gpu_memory_gb, **kwargs)
                 for lay in candidate_layouts(config, gpus)]
    return sorted((e for e in estimates if e.fits), key=rank_key)


def describe(estimate: Estimate) -> str:
    """One line: the layout and its memory parts in GiB."""
    lay, mem = estimate.layout, estimate.memory_gb()
    recompute = lay.recompute if lay.recompute != "full" else \
        f"full/{lay.recompute_method}/{lay.recompute_num_layers}"
    parts = ", ".join(f"{k} {v:.2f}" for k, v in mem.items())
    return (f"TP {lay.tensor_model_parallel_size} x DP {lay.data_parallel_size}, ZeRO {lay.zero_stage}, "
            f"micro-batch {lay.micro_batch_size}, recompute {recompute}, SP {'on' if lay.sequence_parallel else 'off'}"
            f": {parts} GiB per GPU")
