"""Typed configuration for every part of a domino run.

Each field carries a one-line docstring directly below it; ``domino.config.flags`` reads those
docstrings to build the ``--help`` text of the matching Megatron-style flag (``num_layers`` ->
``--num-layers``, :mod:`domino.config.field_docs`), so the documentation lives in exactly one place. Validation lives in
``domino.config.validate``; nothing here checks values. Frozen: resolving a default makes a new value
(:meth:`DominoConfig.replace`), so what was validated is what runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass(frozen=True)
class ModelConfig:
    """Shape and regularisation of the GPT model."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_attention_heads: int = 4
    """Number of attention heads; must divide --hidden-size and be divisible by the TP size."""
    ffn_hidden_size: Optional[int] = None
    """Width of the MLP's inner layer (default: 4 x --hidden-size)."""
    seq_length: int = 128
    """Training sequence length in tokens."""
    max_position_embeddings: Optional[int] = None
    """Number of learned position embeddings (default: --seq-length)."""
    vocab_size: Optional[int] = None
    """Vocabulary size before padding (default: taken from the tokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this value times the TP size (Megatron semantics)."""
    hidden_dropout: float = 0.1
    """Dropout probability after the attention and MLP output projections."""
    attention_dropout: float = 0.1
    """Dropout probability on the attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    norm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm or RMSNorm (also --layernorm-epsilon, the older Megatron spelling)."""
    normalization: str = "LayerNorm"
    """Normalization layer: LayerNorm (GPT) or RMSNorm (LLaMA: x / rms(x) x weight, no bias, no centering)."""
    position_embedding_type: str = "learned_absolute"
    """Position embeddings: learned_absolute (GPT: a learned table added to the word embeddings) or rope (LLaMA:
    rotary embeddings applied to queries and keys in every layer)."""
    use_rotary_position_embeddings: bool = False
    """Megatron's older spelling of --position-embedding-type rope."""
    rotary_base: int = 10000
    """Base of the rotary embedding frequencies, with --position-embedding-type rope (LLaMA 3: 500000)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that are rotated, with --position-embedding-type rope."""
    use_rope_scaling: bool = False
    """Llama 3.x frequency scaling of the rotary embeddings (transformers' rope_type "llama3" with low_freq_factor
    1, high_freq_factor 4 and original_max_position_embeddings 8192, the values Megatron-LM fixes)."""
    rope_scaling_factor: float = 8.0
    """The factor of --use-rope-scaling: long wavelengths are stretched by it (Llama 3.1: 8, Llama 3.2: 32)."""
    swiglu: bool = False
    """SwiGLU MLP: fc2(silu(x W_gate) * x W_up) instead of fc2(gelu(fc1(x))); --ffn-hidden-size then defaults to
    Megatron's int(8 h / 3 / 64) x 64."""
    disable_bias_linear: bool = False
    """Linear layers without biases (LLaMA)."""
    untie_embeddings_and_output_weights: bool = False
    """An output layer with its own weights instead of the word embeddings (LLaMA)."""
    group_query_attention: bool = False
    """Grouped-query attention: --num-query-groups key/value heads, each shared by a group of query heads."""
    num_query_groups: int = 1
    """Key/value heads of --group-query-attention; divides --num-attention-heads and is divisible by the TP size."""
    llama_model: bool = False
    """DeepSpeed-Domino's flag (declared, read nowhere: its pretrain_llama.py builds the LLaMA model); no effect:
    the LLaMA options are --position-embedding-type rope --normalization RMSNorm --swiglu and the others."""

    @property
    def ffn_size(self) -> int:
        """The MLP inner width with its default resolved (Megatron's ``validate_args``: 4 h, or int(8 h / 3 / 64)
        x 64 with --swiglu so that its three matrices hold as many weights as GeLU's two)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def rope(self) -> bool:
        """Whether positions enter as rotary embeddings (either spelling of the flag)."""
        return self.position_embedding_type == "rope" or self.use_rotary_position_embeddings

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups with --group-query-attention, else one per attention head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def num_positions(self) -> int:
        """The number of position embeddings with its default resolved."""
        return self.max_position_embeddings or self.seq_length


@dataclass(frozen=True)
class ParallelConfig:
    """How the model and the data are spread over processes."""

    tensor_model_parallel_size: int = 1
    """Number of processes that split every layer (tensor parallelism)."""
    domino_chunks: Optional[int] = None
    """Micro-chunks per layer input for Domino overlap; 1 means plain synchronous tensor parallelism (default: 2
    when --tensor-model-parallel-size > 1 and --micro-batch-size is even, else 1)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages: the transformer layers divided evenly among them, run on the 1F1B schedule of
    torch.distributed.pipelining; ranks in Megatron's order (TP fastest, then data parallel, then pipeline)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline stage, run on the interleaved 1F1B schedule (stage r holds virtual stages r,
    r + PP, r + 2 PP, ...); needs --pipeline-model-parallel-size >= 2 and a multiple of it micro-batches per step.
    Also spelt --num-virtual-stages-per-pipeline-rank, or derived from --num-layers-per-virtual-pipeline-stage N as
    num-layers / (PP x N) (default: 1, plain 1F1B)."""
    context_parallel_size: int = 1
    """Processes that split every sequence (context parallelism): rank r holds chunks r and 2 CP - 1 - r of its
    2 x CP chunks, keys and values go around a ring of them, gradients are reduced over DP x CP (Megatron's order)."""
    cp_comm_type: str = "p2p"
    """How context-parallel attention communicates: p2p, a ring of key/value blocks (the next in flight while one is
    computed, merged by log-sum-exp); a2a, an all-to-all over heads (Ulysses; heads per TP rank divisible by CP)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: LayerNorm, dropout and residual regions split along the sequence over the TP
    ranks (reduce-scatter after row-parallel, all-gather before column-parallel linears); no effect at TP 1."""
    overlap_grad_reduce: bool = False
    """Under pipeline stages, all-reduce each bucket of a stage's gradients over the data-parallel replicas as soon
    as the last micro-batch's backward has made it final, overlapped with the rest of the backward (Megatron's
    flag); fp32 (ZeRO 0 or 1), bf16 (DeepSpeed's fp32 gradient buffers are the buckets) and fp16 (ZeRO 1)."""
    zero_stage: Optional[int] = None
    """DeepSpeed ZeRO stage for data parallelism (0, 1 or 2; default: the stage of the checkpoint resumed, else 0
    with one data-parallel replica and neither --bf16 nor --fp16, where ZeRO has nothing to shard, else 1)."""
    distributed_backend: Optional[str] = None
    """torch.distributed backend (default: nccl with CUDA, else gloo)."""
    distributed_timeout_minutes: int = 10
    """Timeout of every torch.distributed collective (world, TP and DP groups), in minutes: a peer that hangs
    stops the run after this long (on NCCL through TORCH_NCCL_ASYNC_ERROR_HANDLING, set to 3 unless given)."""
    hang_timeout_s: Optional[float] = None
    """Seconds a rank may make no progress in training steps before the ranks it holds name it (host, pid, iteration),
    dump their stacks and exit 142; default: 10x the slowest recent step, at least 180 s and at most half the
    collective timeout; 0: off. Must be shorter than --distributed-timeout-minutes."""
    local_rank: Optional[int] = None
    """Set by the deepspeed launcher (also --local_rank); ignored: the LOCAL_RANK environment variable is used."""


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, schedule and precision."""

    micro_batch_size: int = 4
    """Samples per process per forward/backward pass."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all data-parallel ranks (default: micro x DP)."""
    train_iters: Optional[int] = None
    """Number of optimizer steps to train for."""
    train_samples: Optional[int] = None
    """Number of samples to train for (alternative to --train-iters)."""
    rampup_batch_size: Optional[List[int]] = None
    """Megatron's batch-size ramp-up START INCR SAMPLES (needs --train-samples): the global batch starts at START
    and grows by INCR, evenly over the first SAMPLES consumed samples, up to --global-batch-size."""
    step_batch_size_schedule: Optional[str] = None
    """Megatron's step schedule "THRESHOLD:BS ..." (needs --train-samples, no --global-batch-size): the global
    batch is BS from THRESHOLD consumed tokens on (K/M/B/T suffixes; the first threshold is 0)."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_decay_style: str = "linear"
    """Learning-rate decay: constant, linear, cosine, inverse-square-root or WSD."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the learning rate decays (default: --train-iters)."""
    lr_decay_samples: Optional[int] = None
    """Samples over which the learning rate decays, with --train-samples (default: --train-samples)."""
    lr_warmup_iters: int = 0
    """Iterations of linear warm-up."""
    lr_warmup_samples: int = 0
    """Samples of linear warm-up, with --train-samples."""
    lr_warmup_fraction: Optional[float] = None
    """Warm-up as a fraction of the decay length (alternative to --lr-warmup-iters/--lr-warmup-samples)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of warm-up (the first step's rate)."""
    lr_wsd_decay_style: str = "exponential"
    """Annealing shape of the last phase of --lr-decay-style WSD: exponential, linear or cosine."""
    lr_wsd_decay_iters: Optional[int] = None
    """Iterations of the WSD annealing phase (ending at --lr-decay-iters)."""
    lr_wsd_decay_samples: Optional[int] = None
    """Samples of the WSD annealing phase, with --train-samples."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and LayerNorm)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    seed: int = 1234
    """Random seed for weights, dropout and data order."""
    fp16: bool = False
    """Train in fp16 with dynamic loss scaling."""
    bf16: bool = False
    """Train in bf16 (GPUs) with fp32 master weights and fp32 gradient accumulation (ZeRO 0: domino's own; 1 or 2:
    DeepSpeed's)."""
    fp8_format: Optional[str] = None
    """FP8 GEMMs in the tensor-parallel linears (Megatron-LM's flag): e4m3, or hybrid (e5m2 output gradients);
    torchao's tensorwise recipe, emulated on CPU, real on GPUs of compute capability 8.9+ (domino.parallel.fp8)."""
    initial_loss_scale: float = 2.0**32
    """Initial dynamic loss scale for --fp16."""
    deepspeed_config: Optional[str] = None
    """JSON file whose keys override the DeepSpeed config domino builds."""
    max_nan_steps: int = 5
    """Stop with an error after this many consecutive non-finite losses."""
    eval_interval: int = 1000
    """Run validation every this many iterations (0 disables)."""
    eval_iters: int = 100
    """Batches per validation or test evaluation."""
    exit_interval: Optional[int] = None
    """Stop (after saving) when the iteration is a multiple of this value."""
    exit_signal_handler: bool = False
    """On SIGTERM to any rank (pod preemption), every rank saves a checkpoint at the next step and exits with 143."""
    inprocess_restart: bool = False
    """A failed step on any rank (an exception, a lost peer) is survived by the same processes: every rank leaves
    its process groups, forms them again on the same rendezvous store and resumes from the newest checkpoint of
    --load (Megatron-LM's flag, after nvidia-resiliency-ext's in-process restart); at most 3 times per process."""
    recompute_activations: bool = False
    """Selective activation recompute: each layer's attention core keeps only q, k, v and is recomputed in backward."""
    recompute_granularity: Optional[str] = None
    """Activation recompute granularity: selective (the attention core, as --recompute-activations) or full (whole
    layers keep only their input; needs --recompute-method and --recompute-num-layers)."""
    recompute_method: Optional[str] = None
    """Full recompute: uniform (groups of --recompute-num-layers layers, each keeping one input) or block (only the
    first --recompute-num-layers layers recompute)."""
    recompute_num_layers: Optional[int] = None
    """Full recompute: layers per group (uniform) or recomputed layers (block), 1 to --num-layers."""


@dataclass(frozen=True)
class DataConfig:
    """Where training data comes from and how batches are built."""

    data_path: List[str] = field(default_factory=list)
    """Dataset prefixes, optionally weighted: 'prefix' or '0.3 a 0.7 b'."""
    split: str = "969,30,1"
    """Train/valid/test split of --data-path documents, e.g. 949,50,1."""
    train_data_path: List[str] = field(default_factory=list)
    """Separate (optionally weighted) prefixes for training."""
    valid_data_path: List[str] = field(default_factory=list)
    """Separate (optionally weighted) prefixes for validation."""
    test_data_path: List[str] = field(default_factory=list)
    """Separate (optionally weighted) prefixes for test."""
    data_cache_path: Optional[str] = None
    """Directory for cached sample indices (default: beside the data)."""
    mmap_warmup: bool = False
    """Read every page of the datasets once before training."""
    tokenizer: str = "gpt2"
    """Tokenizer: 'gpt2' (offline GPT-2 BPE), a tokenizer.json, or a directory holding one."""
    tokenizer_type: Optional[str] = None
    """Megatron tokenizer type: GPT2BPETokenizer (--vocab-file, --merge-file), HuggingFaceTokenizer
    (--tokenizer-model) or NullTokenizer (--vocab-size, preprocessed data); default: --tokenizer."""
    vocab_file: Optional[str] = None
    """GPT-2 BPE vocabulary (Megatron's gpt2-vocab.json); with --merge-file it replaces --tokenizer."""
    merge_file: Optional[str] = None
    """GPT-2 BPE merges (Megatron's gpt2-merges.txt), with --vocab-file."""
    tokenizer_model: Optional[str] = None
    """Local tokenizer.json file or directory for --tokenizer-type HuggingFaceTokenizer."""
    data_impl: str = "mmap"
    """Indexed-dataset implementation (Megatron before 2023-09): mmap or infer; both read the .bin/.idx with mmap."""
    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens."""
    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss."""
    mock_data: bool = False
    """Train on random tokens (benchmarks); no --data-path needed."""
    num_workers: int = 2
    """Data-loader worker processes."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming."""

    save: Optional[str] = None
    """Directory to write checkpoints into."""
    save_interval: Optional[int] = None
    """Save every this many iterations (a final save always happens with --save)."""
    load: Optional[str] = None
    """Directory to resume from (its latest checkpoint); starts fresh when it holds none. Default: --save."""
    keep_last: Optional[int] = None
    """Keep only this many most recent checkpoints."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on (Megatron's flag): the step pays only for
    copying the state to host memory; the checkpoint is committed (and `latest` moved) at a later step, once
    every rank's files are durable. At most one save is in flight; SIGTERM and the end of training wait for it."""
    finetune: bool = False
    """With --load: take the model weights only and start at iteration 0 (warm start)."""
    no_load_optim: bool = False
    """With --load: skip the optimizer state (fresh optimizer)."""
    no_load_rng: bool = False
    """With --load: skip the random-number-generator states."""
    override_opt_param_scheduler: bool = False
    """With --load: take this run's learning-rate schedule and batch ramp where they differ from the
    checkpoint's (Megatron's --override-opt_param-scheduler); without either of the two, a change is refused."""
    use_checkpoint_opt_param_scheduler: bool = False
    """With --load: take the checkpoint's learning-rate schedule and batch ramp where they differ from this run's
    (Megatron's --use-checkpoint-opt_param-scheduler)."""
    strict_load: bool = False
    """With --load: refuse to start when the latest checkpoint is damaged, instead of falling back (with a
    warning) to the newest intact one."""
    save_lock_timeout_s: float = 240.0
    """Seconds to wait for another live run that holds --save (one writer per save root) before stopping with
    one line naming it. A replacement pod can start while its predecessor still saves after SIGTERM, for up to
    that pod's grace period (the launcher's --termination-grace-period, 180 s by default), so the default
    waits that long plus a minute; 0 refuses at once."""


@dataclass(frozen=True)
class LoggingConfig:
    """What a run reports."""

    log_interval: int = 100
    """Log one line every this many iterations."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard events here (Megatron's tag names: lm loss, learning-rate, grad-norm, ...)."""
    log_timers_to_tensorboard: bool = False
    """Also write iteration-time to TensorBoard (Megatron's switch)."""
    metrics_file: Optional[str] = None
    """Append one JSON object per logged iteration and per evaluation to this file."""
    timing_log_level: int = 0
    """0: no timers; 1: step-level timers; 2: every timer."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device for MFU (default: detected for known GPUs)."""
    metrics_port: int = 0
    """Rank 0 serves Prometheus metrics (tokens/s, loss, MFU, iteration time) on this port (0: off; needs the
    metrics extra, prometheus-client); the job's pods declare it as the container port `metrics`."""
    log_straggler: bool = False
    """Every log interval, compare each rank's compute time per step (less its time blocked in TP collectives) and
    name the ranks more than 10% slower than the median (Megatron's flag; a gloo all-gather of a few bytes)."""
    mlflow_experiment_name: Optional[str] = None
    """MLflow experiment when MLFLOW_TRACKING_URI is set (default: $MLFLOW_EXPERIMENT_NAME, else domino)."""
    mlflow_run_name: Optional[str] = None
    """Name of a new MLflow run (default: the pipeline run id, else MLflow's); a resumed run keeps its run."""


@dataclass(frozen=True)
class KernelConfig:
    """Megatron-LM kernel and fusion switches: accepted so launch scripts run unchanged; no effect here."""

    use_flash_attn: bool = False
    """No effect: attention runs on torch SDPA, which picks FlashAttention by itself on GPUs that support it."""
    attention_backend: Optional[str] = None
    """No effect: attention runs on torch SDPA, which chooses its own kernel (flash, memory-efficient, math)."""
    gradient_accumulation_fusion: bool = True
    """No effect (--no-gradient-accumulation-fusion): domino has no fused weight-gradient accumulation kernel."""
    masked_softmax_fusion: bool = True
    """No effect (--no-masked-softmax-fusion): SDPA fuses scaling, masking and softmax itself."""
    bias_gelu_fusion: bool = True
    """No effect (--no-bias-gelu-fusion): domino has no fused bias-GeLU kernel."""
    bias_dropout_fusion: bool = True
    """No effect (--no-bias-dropout-fusion): domino has no fused bias-dropout-add kernel."""
    async_tensor_model_parallel_allreduce: bool = True
    """No effect (--no-async-tensor-model-parallel-allreduce): Domino schedules its own asynchronous all-reduces."""
    persist_layer_norm: bool = True
    """No effect (--no-persist-layer-norm): domino uses torch's LayerNorm kernel."""
    use_distributed_optimizer: bool = False
    """No effect: optimizer state is sharded over data-parallel ranks by ZeRO (--zero-stage) instead."""
    causal_lm: bool = False
    """No effect: DeepSpeed-Domino's switch for a causal mask, which GPT always uses."""


@dataclass(frozen=True)
class DominoConfig:
    """Everything a run needs, grouped by concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    preset: Optional[str] = None
    """Name of the preset the run started from, for the record."""

    GROUPS = ("model", "parallel", "train", "data", "checkpoint", "logging", "kernels")

    def replace(self, **fields: Any) -> "DominoConfig":
        """A copy with ``fields`` (flat names, each of one group: ``zero_stage=1``) changed; KeyError for others."""
        owners = {name: g for g in self.GROUPS for name in getattr(self, g).__dataclass_fields__}
        groups: dict = {}
        for name, value in fields.items():
            groups.setdefault(owners[name], {})[name] = value
        return dataclasses.replace(self, **{g: dataclasses.replace(getattr(self, g), **c) for g, c in groups.items()})
