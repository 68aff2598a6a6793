"""Typed configuration for every part of a domino run.

Each field carries a one-line docstring directly below it; ``domino.config.flags`` reads those
docstrings to build the ``--help`` text of the matching Megatron-style flag (``num_layers`` ->
``--num-layers``), so the documentation lives in exactly one place. Validation lives in
``domino.config.validate``; nothing here checks values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
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
    layernorm_epsilon: float = 1e-5
    """Epsilon of every LayerNorm."""

    @property
    def ffn_size(self) -> int:
        """The MLP inner width with its default resolved."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def num_positions(self) -> int:
        """The number of position embeddings with its default resolved."""
        return self.max_position_embeddings or self.seq_length


@dataclass
class ParallelConfig:
    """How the model and the data are spread over processes."""

    tensor_model_parallel_size: int = 1
    """Number of processes that split every layer (tensor parallelism)."""
    domino_chunks: int = 1
    """Micro-chunks per layer input for Domino overlap; 1 means plain synchronous tensor parallelism."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage for data parallelism (0, 1 or 2)."""
    distributed_backend: Optional[str] = None
    """torch.distributed backend (default: nccl with CUDA, else gloo)."""


@dataclass
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
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_decay_style: str = "cosine"
    """Learning-rate decay: constant, linear or cosine."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the learning rate decays (default: --train-iters)."""
    lr_warmup_iters: int = 0
    """Iterations of linear warm-up."""
    lr_warmup_fraction: Optional[float] = None
    """Warm-up as a fraction of --lr-decay-iters (alternative to --lr-warmup-iters)."""
    weight_decay: float = 0.01
    """AdamW weight decay (not applied to biases and LayerNorm)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
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
    """Train in bf16 (GPUs)."""
    initial_loss_scale: float = 2.0**16
    """Initial dynamic loss scale for --fp16."""
    deepspeed_config: Optional[str] = None
    """JSON file whose keys override the DeepSpeed config domino builds."""
    max_nan_steps: int = 5
    """Stop with an error after this many consecutive non-finite losses."""
    eval_interval: int = 1000
    """Run validation every this many iterations (0 disables)."""
    eval_iters: int = 10
    """Batches per validation or test evaluation."""
    exit_interval: Optional[int] = None
    """Stop (after saving) when the iteration is a multiple of this value."""
    exit_signal_handler: bool = False
    """On SIGTERM (pod preemption), save a checkpoint after the current iteration and exit with status 143."""


@dataclass
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


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: Optional[str] = None
    """Directory to write checkpoints into."""
    save_interval: Optional[int] = None
    """Save every this many iterations (a final save always happens with --save)."""
    load: Optional[str] = None
    """Directory to resume from (its latest checkpoint); starts fresh when it holds none."""
    keep_last: Optional[int] = None
    """Keep only this many most recent checkpoints."""
    finetune: bool = False
    """With --load: take the model weights only and start at iteration 0 (warm start)."""
    no_load_optim: bool = False
    """With --load: skip the optimizer state (fresh optimizer)."""
    no_load_rng: bool = False
    """With --load: skip the random-number-generator states."""
    strict_load: bool = False
    """With --load: refuse to start when the latest checkpoint is damaged, instead of falling back (with a
    warning) to the newest intact one."""


@dataclass
class LoggingConfig:
    """What a run reports."""

    log_interval: int = 10
    """Log one line every this many iterations."""
    tensorboard_dir: Optional[str] = None
    """Write TensorBoard events here."""
    metrics_file: Optional[str] = None
    """Append one JSON object per logged iteration and per evaluation to this file."""
    timing_log_level: int = 0
    """0: no timers; 1: step-level timers; 2: every timer."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device for MFU (default: detected for known GPUs)."""


@dataclass
class DominoConfig:
    """Everything a run needs, grouped by concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    preset: Optional[str] = None
    """Name of the preset the run started from, for the record."""

    GROUPS = ("model", "parallel", "train", "data", "checkpoint", "logging")
