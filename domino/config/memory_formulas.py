"""The closed forms behind ``domino estimate``: bytes and FLOPs of a model's parts on one GPU of a layout.

Memory per GPU is the sum of seven parts, each a closed form in the architecture fields and the layout
(:mod:`domino.config.estimate` adds them up per pipeline stage):

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
* **buffers**: DeepSpeed's ZeRO reduce/all-gather buckets (sizes from ``domino/optim/deepspeed_config.py``), the per-layer
  regrouped QKV weight copy of :mod:`domino.model.qkv_projection` and full recompute's RNG snapshots.
* **fp32_grads**: the fp32 gradients kept beyond the paper's count (DeepSpeed's fp32 gradient buffer of bf16 ZeRO 1,
  domino's fp32 main gradients of bf16/fp16 ZeRO 0, the fp32 gradient partitions of 16-bit ZeRO 1/2, the engine's
  flattening all-reduce buffer): :mod:`domino.config.deepspeed_memory`,
  which also says which of these figures have been measured (:data:`VALIDATION`: none on a GPU yet).

FLOPs per token follow Megatron's count (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters", appendix: ``72 B s L h^2 (1 + s/6h + V/12Lh)`` per batch), written per matrix so SwiGLU and GQA
plug in; full recompute adds one more forward (4 instead of 3 passes).

The LLaMA-family fields (``swiglu``, grouped-query attention, ``untie_embeddings_and_output_weights``,
``disable_bias_linear``, rotary positions, ``normalization``) change the counts where they change the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from domino.config.schema import ModelConfig

RECOMPUTE_CHOICES = ("none", "selective", "full")
DEVICES = ("gpu", "cpu")


@dataclass
class Layout:
    """How one run is spread over GPUs, and which memory levers it pulls."""

    tensor_model_parallel_size: int = 1
    """Processes that split every layer."""
    data_parallel_size: int = 1
    """Model replicas (GPUs / (TP x PP x CP))."""
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
    pipeline_model_parallel_size: int = 1
    """Pipeline stages, each holding num_layers / PP consecutive layers (domino.config.pipeline_schedule)."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per stage: the interleaved schedule above 1, plain 1F1B at 1."""
    context_parallel_size: int = 1
    """Processes that split every sequence: each holds seq / CP tokens of every layer's activations."""



@dataclass
class ModelShape:
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
    def of(cls, model: ModelConfig, vocab: int) -> "ModelShape":
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



def parameter_counts(shape: ModelShape, tp: int) -> Dict[str, float]:
    """Counts of parameters: ``total`` (the whole model), ``per_rank`` (one TP rank's share of it), and one TP rank's
    ``layer`` (one transformer layer), ``embedding`` (word and position embeddings), ``output`` (the untied output
    layer, else 0; also the size of a tied copy), ``final_norm``: the parts a pipeline stage adds up."""
    h, L = shape.h, shape.L
    sharded_layer = h * shape.qkv_width + h * h + h * shape.fc1_width + shape.f * h
    sharded_bias = (shape.qkv_width + shape.fc1_width) if shape.bias else 0
    replicated_layer = 2 * shape.norm_params + (2 * h if shape.bias else 0)  # norms, row-parallel biases
    vocab = shape.V * h * (2 if shape.untied else 1)
    sharded = L * (sharded_layer + sharded_bias) + vocab
    replicated = L * replicated_layer + shape.norm_params + shape.positions * h
    return {"total": sharded + replicated, "per_rank": sharded / tp + replicated,
            "layer": (sharded_layer + sharded_bias) / tp + replicated_layer,
            "embedding": shape.V * h / tp + shape.positions * h, "output": shape.V * h / tp if shape.untied else 0,
            "vocab_matrix": shape.V * h / tp, "final_norm": shape.norm_params}


def layer_activation_bytes(shape: ModelShape, layout: Layout, act_bytes: int,
                           device: str = "gpu", cp_comm_type: str = "p2p") -> Tuple[float, float]:
    """``(stored, peak)``: bytes one micro-batch's pass through ``shape.L`` layers of one TP rank keeps for backward
    (``stored``), and the most alive during its backward, with a recomputed block back on top (``peak``); see the
    module doc.

    ``device`` decides two kernel choices of torch: on GPUs dropout keeps a 1-byte mask and SDPA runs a fused
    kernel; on CPUs dropout keeps a noise tensor of the activation's dtype (``is_fused_kernel_acceptable`` in
    pytorch's aten/src/ATen/native/Dropout.cpp is true only for CUDA/XPU/lazy/privateuse1 tensors) and SDPA falls
    back to the math path when attention dropout is on. Under context parallelism (``layout.context_parallel_size``
    > 1, ``shape.s`` this rank's tokens) the ring (``p2p``) keeps its merged output and log-sum-exp whatever its
    blocks' kernel (its math blocks are recomputed in backward), and the all-to-all (``a2a``) runs SDPA over the
    whole sequence for ``1 / CP`` of the heads: CP times the scores of the math path.
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
    cp = layout.context_parallel_size
    math_path = device == "cpu" and shape.attention_dropout > 0 and (cp == 1 or cp_comm_type == "a2a")
    if math_path:  # Korthikanti's softmax, mask, dropout output (a2a: the whole sequence's, 1 / CP of the heads)
        core = (2 * act_bytes + mask_bytes) * shape.a * s * s * b * cp / t
    else:  # fused SDPA: the output and a fp32 logsumexp per row
        core = act_bytes * sbh / t + 4 * shape.a * s * b / t
    mlp = (shape.fc1_width + shape.f) * s * b * act_bytes / t
    full_layer = stream + attention + core + mlp
    layer_input = act_bytes * sbh / sp
    # Backward peaks where a recomputed block is alive again on top of what is still stored; Domino recomputes
    # one chunk's block at a time.
    chunks = max(1, layout.domino_chunks)
    if layout.recompute == "selective":  # every core dropped; one layer's core alive again at a time
        stored = shape.L * (full_layer - core)
        return stored, stored + core / chunks
    if layout.recompute == "full":
        n = max(1, min(layout.recompute_num_layers, shape.L))
        if layout.recompute_method == "block":  # the first n layers keep inputs only, recomputed after the rest
            stored = n * layer_input + (shape.L - n) * full_layer
            return stored, n * layer_input + max((shape.L - n) * full_layer, full_layer / chunks)
        # uniform: the input of every group of n layers, and one group recomputed at a time
        stored = -(-shape.L // n) * layer_input
        return stored, stored + n * full_layer / chunks
    return shape.L * full_layer, shape.L * full_layer


def embedding_activation_bytes(shape: ModelShape, layout: Layout, act_bytes: int, device: str = "gpu") -> float:
    """The embedding's dropout mask (drawn before the SP split), per micro-batch: on the first pipeline stage."""
    mask_bytes = 1 if device == "gpu" else act_bytes
    return (mask_bytes if shape.hidden_dropout > 0 else 0) * shape.s * layout.micro_batch_size * shape.h


def final_norm_activation_bytes(shape: ModelShape, layout: Layout, act_bytes: int) -> float:
    """The final norm's input (SP-split) and output (gathered), per micro-batch: on the last pipeline stage."""
    sbh = shape.s * layout.micro_batch_size * shape.h
    sp = layout.tensor_model_parallel_size if layout.sequence_parallel else 1
    return act_bytes * sbh / sp + act_bytes * sbh


def activation_bytes(shape: ModelShape, layout: Layout, act_bytes: int, device: str = "gpu") -> float:
    """Bytes saved for backward by one TP rank's whole model at the peak of one micro-batch's backward (no
    pipeline): :func:`layer_activation_bytes`'s peak plus the embedding's and the final norm's."""
    return (layer_activation_bytes(shape, layout, act_bytes, device)[1]
            + embedding_activation_bytes(shape, layout, act_bytes, device)
            + final_norm_activation_bytes(shape, layout, act_bytes))


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


def logits_bytes(shape: ModelShape, layout: Layout, act_bytes: int, device: str = "gpu") -> float:
    """The fp32 softmax of the fused vocabulary-parallel cross-entropy, plus the 16-bit logits it came from; on
    GPUs only one row chunk of them (domino/parallel/chunked_cross_entropy.py) plus, in 16-bit, the output layer's
    fp32 gradient accumulator and one 16-bit chunk product."""
    tokens, columns = shape.s * layout.micro_batch_size, shape.V / layout.tensor_model_parallel_size
    extra = act_bytes if act_bytes != 4 else 0
    rows = tokens if device != "gpu" else min(tokens, max(1, GPU_LOSS_CHUNK_BYTES // (4 * columns)))
    accumulator = columns * shape.h * (4 + act_bytes) if extra and rows < tokens else 0
    return rows * columns * (4 + extra) + accumulator


def context_parallel_bytes_per_layer(local: ModelShape, layout: Layout, comm_type: str, act_bytes: int) -> float:
    """Bytes one rank sends for its context-parallel attention in one layer's forward and backward of one
    micro-batch (``local``: the shape at this rank's ``s / CP`` tokens; 0 at CP 1). With ``N`` ranks and, per TP
    rank, queries of ``h / t`` and keys and values of ``2 h g / t`` values per token (``g``: key/value heads per
    head):

    * ``p2p`` (:mod:`domino.parallel.ring_attention`): ``N - 1`` key/value blocks forward and again backward, and
      the ``N`` fp32 key/value gradient blocks that travel home;
    * ``a2a`` (:mod:`domino.parallel.all_to_all_attention`): ``(N - 1) / N`` of queries, keys, values and output
      each way, forward and (their gradients) backward.

    Full recompute runs the forward's exchange once more.
    """
    n, t = layout.context_parallel_size, layout.tensor_model_parallel_size
    if n == 1:
        return 0.0
    tokens = local.s * layout.micro_batch_size
    kv = tokens * 2 * local.h * local.kv_fraction / t  # values of one rank's key/value block
    forward_passes = 2 if layout.recompute == "full" else 1
    if comm_type == "a2a":
        exchanged = (n - 1) / n * tokens * 2 * local.h * (1 + local.kv_fraction) / t * act_bytes
        return (forward_passes + 1) * exchanged
    return (forward_passes + 1) * (n - 1) * kv * act_bytes + n * kv * 4


#: Whether the ring's blocks run a fused kernel that returns the log-sum-exp, by device, without attention dropout
#: and with it (CPUs' fused kernel has no dropout: the textbook softmax then): ``ring_blocks_fused`` and
#: ``ring_blocks_fuse_dropout`` of ``domino.parallel.kernels``' CPU and CUDA tables (a test keeps them equal). On
#: GPUs the fused blocks are FlashAttention or memory-efficient attention where they take the inputs (bf16 and
#: fp16 runs; counted so), not yet run on a GPU.
RING_BLOCKS_FUSED = {"cpu": True, "gpu": True}
RING_BLOCKS_FUSE_DROPOUT = {"cpu": False, "gpu": True}


def attention_transient_bytes(local: ModelShape, layout: Layout, comm_type: str, act_bytes: int,
                              device: str = "gpu") -> float:
    """The most bytes one layer's context-parallel attention holds beyond what it saves for backward, per TP rank
    (``local``: the shape at this rank's ``s / CP`` tokens; 0 at CP 1), forward or backward whichever is more; one
    Domino chunk's (``b / chunks`` samples) at a time. Counted from the code, checked against live tensor bytes
    (``benchmarks/estimate_check.py``). With ``H`` query and ``G`` key/value heads per TP rank, head size ``d``:

    * ``p2p`` (:mod:`domino.parallel.ring_attention`): the key/value block held and the one arriving (``2`` blocks
      of ``2 b G s d``); forward the fp32 running output and the block's output, backward the fp32 query gradient,
      the fp32 key/value gradient in flight and the one arriving, and the block's ``dq, dk, dv``; with GQA the
      block's keys and values expanded to ``H`` heads (memory-efficient attention's and the CPU kernel's; an upper
      bound for FlashAttention, which takes them unexpanded). A block of the textbook softmax (on CPUs with
      attention dropout: :data:`RING_BLOCKS_FUSED`, :data:`RING_BLOCKS_FUSE_DROPOUT`) holds ``3`` (forward) or ``5`` (backward) fp32 copies of its
      ``b H s s`` scores at once, ``1.25`` more with dropout (the kept mask and the dropped probabilities).
    * ``a2a`` (:mod:`domino.parallel.all_to_all_attention`): the exchange's send and receive buffers of queries,
      keys and values (forward and, with their gradients, backward) and of the output (forward); the textbook
      softmax of CPUs with dropout adds one fp32 copy of its whole-sequence scores in backward.
    """
    n, t = layout.context_parallel_size, layout.tensor_model_parallel_size
    if n == 1:
        return 0.0
    b = layout.micro_batch_size / max(1, layout.domino_chunks)
    heads = local.a / t
    d, s = local.h / local.a, local.s
    query = b * heads * s * d  # values of this rank's queries (and of its output)
    kv = 2 * query * local.kv_fraction  # values of one key/value block
    gqa = local.kv_fraction < 1
    dropout = local.attention_dropout > 0
    if comm_type == "a2a":
        exchange = 2 * (query + kv) * act_bytes  # send and receive buffers of q, k and v
        scores = 4 * b * heads / n * (n * s) ** 2 if device == "cpu" and dropout else 0.0
        return max(exchange + 2 * query * act_bytes, exchange + scores)
    blocks = 2 * kv * act_bytes
    forward = blocks + query * (4 + act_bytes)
    backward = blocks + 4 * query + 2 * 4 * kv + 3 * query * act_bytes
    if gqa:  # the block's keys and values repeated to every query head (and their gradients summed back)
        forward += 2 * query * act_bytes
        backward += 2 * query * act_bytes + 4 * kv
    if not RING_BLOCKS_FUSED[device] or (dropout and not RING_BLOCKS_FUSE_DROPOUT[device]):
        scores = 4 * b * heads * s * s
        extra = 1.25 * scores if dropout else 0.0
        forward = blocks + 4 * query + 3 * scores + extra
        backward = blocks + 4 * query + 2 * 4 * kv + 5 * scores + extra
    return max(forward, backward)


def model_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs per token (2 per multiply-add), Megatron's count with the attention square in full."""
    h, s = shape.h, shape.s
    matmuls = h * shape.qkv_width + h * h + h * shape.fc1_width + shape.f * h
    return shape.L * (2 * matmuls + 4 * s * h) + 2 * h * shape.V


def training_flops_per_token(model: ModelConfig, padded_vocab: int) -> float:
    """FLOPs to train on one token without recompute: 3 x :func:`model_flops_per_token` (Megatron's count)."""
    return 3 * model_flops_per_token(ModelShape.of(model, padded_vocab))
