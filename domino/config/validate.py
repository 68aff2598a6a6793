"""All config validation, in one place, with errors that name the flags involved. The bounds of single settings
live in :mod:`domino.config.bounds` (validation checks them first), since the readers of untrusted files, a
checkpoint's config and an imported ``config.json``, hold their fields to the same bounds; the ``--data-path`` and
``--split`` syntax in :mod:`domino.config.data_specs`.

Besides errors, :func:`advisories` lists what a run should say about flags it accepts without acting on
(Megatron-LM's kernel switches, ``--save-interval`` without ``--save``), and :func:`check_device` the settings the
machine cannot run. The Megatron-LM rules cited are from ``megatron/training/arguments.py`` (NVIDIA/Megatron-LM
``core_r0.11.0``, commit 7c00175e6b24b3cd835d21a9d287c35a07e275b3).
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

from domino.config.batch_schedule import batch_schedule_problems, check_batch_flags
from domino.config.bounds import bound_problems
from domino.config.data_specs import data_spec_problems, zero_weight_notes
from domino.config.errors import ConfigError  # noqa: F401  (its home for the callers that import it from here)
from domino.config.layout import (check_tensor_parallel_size, context_parallel_problems, data_parallel_size,
                                  pipeline_problems)
from domino.config.field_docs import field_docs, flag_name
from domino.config.schema import DominoConfig, KernelConfig

#: Megatron's --lr-decay-style choices.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
#: Tokenizer types domino reads; Megatron's others (SentencePiece, TikToken, BERT...) are refused by name.
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
#: Megatron's --attention-backend choices (AttnBackend in megatron/core/transformer/enums.py).
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


def _check(problems: List[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


def resolve_domino_chunks(config: DominoConfig) -> Tuple[DominoConfig, Optional[str]]:
    """``config`` with ``--domino-chunks`` filled in when it was not given, and the start-up note saying what was
    chosen (``None`` when it was given).

    DeepSpeed-Domino always splits each micro-batch in two (``intra_partitions = 2`` in
    ``training/DeepSpeed-Domino/domino/language_model.py``, microsoft/DeepSpeedExamples commit faa04205), so a
    script written for it that does not name ``--domino-chunks`` gets 2 chunks wherever that can work (TP > 1
    and an even micro-batch), never silently plain tensor parallelism.
    """
    p, t = config.parallel, config.train
    if p.domino_chunks is not None:
        return config, None
    tp = p.tensor_model_parallel_size
    if tp > 1 and t.micro_batch_size % 2 == 0:
        return config.replace(domino_chunks=2), (
            f"--domino-chunks not given: 2 (Domino overlap, as DeepSpeed-Domino; --tensor-model-parallel-size {tp} "
            f"> 1 and --micro-batch-size {t.micro_batch_size} is even)")
    reason = "--tensor-model-parallel-size 1" if tp <= 1 else f"--micro-batch-size {t.micro_batch_size} is odd"
    return config.replace(domino_chunks=1), f"--domino-chunks not given: 1 (plain tensor parallelism: {reason})"


def zero_stage_for(config: DominoConfig, data_parallel_size: int) -> int:
    """``--zero-stage`` when given, else the stage a run with ``data_parallel_size`` replicas defaults to.

    With one data-parallel replica ZeRO has nothing to shard, yet DeepSpeed 0.19.8's ZeRO optimizer still
    copies every gradient into its flat fp32 partition and the updated partition back into the weights each step
    (``deepspeed/runtime/zero/stage_1_and_2.py``: ``DeepSpeedZeroOptimizer.reduce_gradients`` and ``step``), so
    stage 0 does the same maths with less work: torch's fused AdamW without DeepSpeed
    (:func:`domino.optim.torch_optimizer.uses_torch_optimizer`), in bf16 and fp16 with domino's fp32 master
    weights and fp32 main gradients (:mod:`domino.optim.mixed_precision`: the arithmetic of DeepSpeed's
    ``BF16_Optimizer``, and fp16's dynamic loss scale decided on the device), with pipeline stages too (their
    norm over every stage, non-finite on all when on one, makes every stage skip and update its scale alike:
    :mod:`domino.train.pipeline_step`).
    """
    if config.parallel.zero_stage is not None:
        return config.parallel.zero_stage
    return 0 if data_parallel_size == 1 else 1


def resolve_zero_stage(config: DominoConfig, data_parallel_size: int,
                       checkpoint_stage: Optional[int] = None) -> Tuple[DominoConfig, Optional[str]]:
    """``config`` with ``--zero-stage`` filled in when it was not given, and the start-up note saying what was
    chosen (``None`` when it was given).

    Resuming a checkpoint's optimizer state keeps that checkpoint's stage (``checkpoint_stage``): ZeRO saves its
    state as flat fp32 partitions, a plain optimizer per parameter (:mod:`domino.checkpoint.resume`). Otherwise
    the default of :func:`zero_stage_for`.
    """
    if config.parallel.zero_stage is not None:
        return config, None
    if checkpoint_stage is not None:
        return config.replace(zero_stage=checkpoint_stage), (f"--zero-stage not given: {checkpoint_stage} (the stage "
                                                             "of the checkpoint whose optimizer state is resumed)")
    stage = zero_stage_for(config, data_parallel_size)
    if stage == 0:
        return config.replace(zero_stage=0), (
            "--zero-stage not given: 0 (one data-parallel replica: ZeRO would shard nothing, only copy gradients "
            "and weights between flat buffers)")
    return config.replace(zero_stage=stage), (f"--zero-stage not given: {stage} ({data_parallel_size} data-parallel "
                                              "replicas)")


def validate(config: DominoConfig, world_size: Optional[int] = None, for_training: bool = False) -> None:
    """Raises :class:`ConfigError` listing every problem in ``config``.

    Args:
        config: the resolved configuration.
        world_size: number of processes of the run, when known; enables the checks that involve the
            data-parallel size (divisibility of the world and of the global batch).
        for_training: also require what ``domino pretrain`` needs (a length, a data source).
    """
    m, p, t, d, c, lg = config.model, config.parallel, config.train, config.data, config.checkpoint, config.logging
    problems: List[str] = []
    tp = p.tensor_model_parallel_size
    problems.extend(bound_problems(config))
    _check(problems, t.fp8_format in (None, "e4m3", "hybrid"),
           f"--fp8-format must be e4m3 or hybrid, got {t.fp8_format!r}")
    if problems:
        raise ConfigError("; ".join(problems))

    _check(problems, m.hidden_size % m.num_attention_heads == 0,
           f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}")
    _check(problems, m.num_attention_heads % tp == 0,
           f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    _check(problems, m.ffn_size % tp == 0,
           f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}")
    _check(problems, m.num_positions >= m.seq_length,
           f"--max-position-embeddings {m.num_positions} is smaller than --seq-length {m.seq_length}")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        _check(problems, 0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")

    _check_architecture(problems, config)

    chunks = p.domino_chunks if p.domino_chunks is not None else 1
    _check(problems, chunks >= 1, f"--domino-chunks must be >= 1, got {p.domino_chunks}")
    _check(problems, t.micro_batch_size % max(chunks, 1) == 0,
           f"--micro-batch-size {t.micro_batch_size} is not divisible by --domino-chunks {p.domino_chunks} "
           "(Domino splits each micro-batch along the batch dimension)")
    _check(problems, not p.sequence_parallel or m.seq_length % tp == 0,
           f"--sequence-parallel: --seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp}")
    _check(problems, p.zero_stage in (None, 0, 1, 2), f"--zero-stage must be 0, 1 or 2, got {p.zero_stage}")
    _check(problems, p.distributed_backend in (None, "gloo", "nccl"),
           f"--distributed-backend must be gloo or nccl, got {p.distributed_backend!r}")
    _check(problems, p.pipeline_model_parallel_size >= 1,
           f"--pipeline-model-parallel-size must be >= 1, got {p.pipeline_model_parallel_size}")
    # Without stages DeepSpeed reduces the gradients itself (overlapped inside its backward at ZeRO 1/2).
    _check(problems, not p.overlap_grad_reduce or p.pipeline_model_parallel_size > 1,
           "--overlap-grad-reduce needs --pipeline-model-parallel-size > 1 (without stages DeepSpeed reduces the "
           "gradients itself)")
    _check(problems, p.distributed_timeout_minutes >= 1,
           f"--distributed-timeout-minutes must be >= 1, got {p.distributed_timeout_minutes}")
    _check(problems, p.hang_timeout_s is None or (math.isfinite(p.hang_timeout_s) and p.hang_timeout_s >= 0),
           f"--hang-timeout-s must be a number >= 0 (0: off), got {p.hang_timeout_s}")
    # torch's collective timeout would end the run first, naming no rank (domino/runtime/hang_watch.py).
    _check(problems, not p.hang_timeout_s or not math.isfinite(p.hang_timeout_s)
           or p.hang_timeout_s < 60 * p.distributed_timeout_minutes,
           f"--hang-timeout-s {p.hang_timeout_s:g} must be shorter than --distributed-timeout-minutes "
           f"{p.distributed_timeout_minutes} ({60 * p.distributed_timeout_minutes} s), whose collective timeout would "
           f"end the run first without naming the hung rank" if p.hang_timeout_s else "")

    _check(problems, t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}")
    _check(problems, not (t.fp16 and t.bf16), "--fp16 and --bf16 are mutually exclusive")
    # --bf16/--fp16 at --zero-stage 0 is domino's own fp32 master weights and fp32 main gradients, no DeepSpeed
    # (domino.optim.mixed_precision): DeepSpeed 0.19.8 itself refuses fp32 accumulation at stage 0.
    _check(problems, not (t.train_iters is not None and t.train_samples is not None),
           "--train-iters and --train-samples are mutually exclusive")
    problems.extend(check_batch_flags(config))
    _check(problems, t.lr_decay_style in LR_DECAY_STYLES,
           f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, got {t.lr_decay_style!r}")
    _check(problems, t.lr_wsd_decay_style in ("exponential", "linear", "cosine"),
           f"--lr-wsd-decay-style must be exponential, linear or cosine, got {t.lr_wsd_decay_style!r}")
    _check(problems, t.lr_decay_style != "WSD" or t.lr_wsd_decay_iters is not None or t.lr_wsd_decay_samples is not None,
           "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)")
    _check(problems, 0.0 <= t.lr_warmup_init <= t.lr, f"need 0 <= --lr-warmup-init ({t.lr_warmup_init}) <= --lr ({t.lr})")
    # Megatron's validate_args: iteration-based runs take --lr-*-iters, sample-based runs --lr-*-samples.
    if t.train_iters is not None:
        given = [flag for flag, value in (("--lr-decay-samples", t.lr_decay_samples),
                                          ("--lr-warmup-samples", t.lr_warmup_samples or None),
                                          ("--lr-wsd-decay-samples", t.lr_wsd_decay_samples)) if value is not None]
        _check(problems, not given, f"{', '.join(given)}: only with --train-samples (this run gives --train-iters)")
    if t.train_samples is not None:
        given = [flag for flag, value in (("--lr-decay-iters", t.lr_decay_iters),
                                          ("--lr-warmup-iters", t.lr_warmup_iters or None),
                                          ("--lr-wsd-decay-iters", t.lr_wsd_decay_iters)) if value is not None]
        _check(problems, not given, f"{', '.join(given)}: only with --train-iters (this run gives --train-samples)")
    _check(problems, t.lr >= 0 and t.min_lr >= 0 and t.min_lr <= t.lr,
           f"need 0 <= --min-lr ({t.min_lr}) <= --lr ({t.lr})")
    _check(problems, t.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {t.lr_warmup_iters}")
    if t.lr_warmup_fraction is not None:
        _check(problems, 0.0 <= t.lr_warmup_fraction <= 1.0,
               f"--lr-warmup-fraction must be in [0, 1], got {t.lr_warmup_fraction}")
        _check(problems, t.lr_warmup_iters == 0 and t.lr_warmup_samples == 0,
               "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are mutually exclusive")
    _check(problems, 0.0 <= t.adam_beta1 < 1.0 and 0.0 <= t.adam_beta2 < 1.0, "--adam-beta1/2 must be in [0, 1)")
    _check(problems, t.clip_grad >= 0, f"--clip-grad must be >= 0, got {t.clip_grad}")
    _check_recompute(problems, config)
    _check(problems, t.max_nan_steps >= 1, f"--max-nan-steps must be >= 1, got {t.max_nan_steps}")
    _check(problems, t.eval_interval >= 0 and t.eval_iters >= 0, "--eval-interval and --eval-iters must be >= 0")

    if world_size is not None:
        try:
            check_tensor_parallel_size(world_size, tp, p.pipeline_model_parallel_size, p.context_parallel_size)
        except ConfigError as error:
            problems.append(str(error))
        else:
            dp = data_parallel_size(config, world_size)
            if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp) != 0:
                problems.append(
                    f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                    f"{t.micro_batch_size} x data-parallel size {dp}")
            elif not problems:
                problems.extend(batch_schedule_problems(config, dp))

    problems += pipeline_problems(config, world_size) + context_parallel_problems(config)
    _check(problems, c.save_interval is None or c.save_interval >= 1,
           f"--save-interval must be >= 1, got {c.save_interval}")
    _check(problems, c.keep_last is None or c.keep_last >= 1, f"--keep-last must be >= 1, got {c.keep_last}")
    _check(problems, 0 <= c.save_lock_timeout_s < math.inf, f"--save-lock-timeout-s must be a finite number of "
           f"seconds >= 0, got {c.save_lock_timeout_s}")
    _check(problems, lg.log_interval >= 1, f"--log-interval must be >= 1, got {lg.log_interval}")
    _check(problems, 0 <= lg.metrics_port <= 65535, f"--metrics-port must be a TCP port (1-65535) or 0, got "
           f"{lg.metrics_port}")
    _check(problems, lg.timing_log_level in (0, 1, 2), f"--timing-log-level must be 0, 1 or 2, got {lg.timing_log_level}")
    _check(problems, d.num_workers >= 0, f"--num-workers must be >= 0, got {d.num_workers}")
    _check_tokenizer_and_data(problems, config)
    problems.extend(data_spec_problems(config.data))
    _check(problems, config.kernels.attention_backend in (None, *ATTENTION_BACKENDS),
           f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {config.kernels.attention_backend!r}")

    if for_training:
        _check(problems, t.train_iters is not None or t.train_samples is not None,
               "one of --train-iters or --train-samples is required")
        _check(problems, bool(d.data_path or d.train_data_path or d.mock_data),
               "no training data: give --data-path (or --train-data-path), or --mock-data")
        _check(problems, not (d.data_path and d.train_data_path),
               "--data-path and --train-data-path are mutually exclusive")
        _check(problems, not (c.finetune and c.load is None), "--finetune needs --load")
        # Megatron asserts the same (megatron/core/optimizer_param_scheduler.py, OptimizerParamScheduler.__init__).
        _check(problems, not (c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler),
               "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other")

    if problems:
        raise ConfigError("; ".join(problems))


def _check_architecture(problems: List[str], config: DominoConfig) -> None:
    """The LLaMA-family options (Megatron-LM's choices and divisibility rules, arguments.py and attention.py)."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    _check(problems, m.position_embedding_type in ("learned_absolute", "rope"),
           f"--position-embedding-type must be learned_absolute or rope, got {m.position_embedding_type!r}")
    _check(problems, m.normalization in ("LayerNorm", "RMSNorm"),
           f"--normalization must be LayerNorm or RMSNorm, got {m.normalization!r}")
    _check(problems, m.norm_epsilon > 0, f"--norm-epsilon must be > 0, got {m.norm_epsilon}")
    swiglu_note = " (the --swiglu default int(8 h / 3 / 64) x 64 is 0 below --hidden-size 96: give it)"
    _check(problems, m.ffn_size >= 1,
           f"--ffn-hidden-size must be >= 1, got {m.ffn_size}" + (swiglu_note if m.swiglu else ""))
    if m.rope:
        rotated = int(m.head_dim * m.rotary_percent)
        _check(problems, 0.0 < m.rotary_percent <= 1.0,
               f"--rotary-percent must be in (0, 1], got {m.rotary_percent}")
        _check(problems, rotated >= 2 and rotated % 2 == 0,
               f"--rotary-percent {m.rotary_percent} rotates {rotated} of the {m.head_dim} dimensions of a head "
               "(--hidden-size / --num-attention-heads); rotary embeddings need an even number >= 2")
        _check(problems, m.rotary_base >= 1, f"--rotary-base must be >= 1, got {m.rotary_base}")
    if m.use_rope_scaling:
        _check(problems, m.rope, "--use-rope-scaling scales rotary embeddings: it needs --position-embedding-type rope")
        _check(problems, m.rope_scaling_factor >= 1.0,
               f"--rope-scaling-factor must be >= 1, got {m.rope_scaling_factor}")
    if m.group_query_attention:
        groups = m.num_query_groups
        _check(problems, groups >= 1, f"--num-query-groups must be >= 1, got {groups}")
        if groups >= 1:
            _check(problems, m.num_attention_heads % groups == 0,
                   f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {groups}")
            # Each TP rank owns whole query groups (their query heads and their one key/value head).
            _check(problems, groups % tp == 0,
                   f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")


def _check_recompute(problems: List[str], config: DominoConfig) -> None:
    """Megatron's rules (``TransformerConfig.__post_init__`` in megatron/core/transformer/transformer_config.py and
    ``--recompute-activations`` meaning selective in megatron/training/arguments.py)."""
    t, layers = config.train, config.model.num_layers
    granularity = t.recompute_granularity
    _check(problems, granularity in (None, "full", "selective"),
           f"--recompute-granularity must be full or selective, got {granularity!r}")
    _check(problems, not (t.recompute_activations and granularity == "full"),
           "--recompute-activations means --recompute-granularity selective; "
           "it contradicts --recompute-granularity full")
    _check(problems, t.recompute_method in (None, "uniform", "block"),
           f"--recompute-method must be uniform or block, got {t.recompute_method!r}")
    if granularity == "full":
        _check(problems, t.recompute_method is not None,
               "--recompute-granularity full needs --recompute-method uniform or block")
        n = t.recompute_num_layers
        _check(problems, n is not None and 1 <= n <= layers,
               f"--recompute-granularity full needs --recompute-num-layers between 1 and --num-layers {layers}, "
               f"got {n}")
        chunks = config.parallel.domino_chunks or 1
        # Each chunk's layers are recomputed in a backward of their own, so a weight's gradient arrives once per
        # chunk; ZeRO 2 reduces per arrival and refuses a second one (deepspeed/runtime/zero/stage_1_and_2.py:
        # "Gradient computed twice for this partition").
        _check(problems, chunks == 1 or (config.parallel.zero_stage or 0) < 2,  # unset resolves to 0 or 1
               f"--recompute-granularity full with --domino-chunks {chunks} needs --zero-stage 0 or 1 (ZeRO 2 "
               "refuses a gradient that arrives once per recomputed chunk)")
    else:
        given = [flag for flag, value in (("--recompute-method", t.recompute_method),
                                          ("--recompute-num-layers", t.recompute_num_layers)) if value is not None]
        _check(problems, not given, f"{', '.join(given)}: only with --recompute-granularity full "
                                    "(selective recompute always recomputes the attention core of every layer)")


def _check_tokenizer_and_data(problems: List[str], config: DominoConfig) -> None:
    d, m = config.data, config.model
    _check(problems, d.data_impl in ("mmap", "infer"),
           f"--data-impl {d.data_impl}: only mmap indexed datasets exist here (Megatron's lazy and cached formats "
           "were removed in Megatron-LM 2023-09); use mmap")
    _check(problems, (d.vocab_file is None) == (d.merge_file is None), "--vocab-file and --merge-file go together")
    _check(problems, d.vocab_file is None or d.tokenizer == "gpt2",
           f"--tokenizer {d.tokenizer} and --vocab-file/--merge-file are mutually exclusive")
    kind = d.tokenizer_type
    if kind is None:
        return
    _check(problems, kind in TOKENIZER_TYPES,
           f"--tokenizer-type {kind} is not supported (supported: {', '.join(TOKENIZER_TYPES)}; for another tokenizer "
           "save it as a tokenizer.json and give --tokenizer-type HuggingFaceTokenizer --tokenizer-model FILE)")
    if kind == "GPT2BPETokenizer":
        _check(problems, d.vocab_file is not None, "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if kind == "HuggingFaceTokenizer":
        _check(problems, d.tokenizer_model is not None, "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
    if kind == "NullTokenizer":
        _check(problems, m.vocab_size is not None,
               "--tokenizer-type NullTokenizer needs --vocab-size (ids below it; the end-of-document id is --vocab-size)")


def advisories(config: DominoConfig) -> List[str]:
    """What a run should log about flags it accepts but does not act on, one line each."""
    notes = []
    c = config.checkpoint
    if c.save_interval is not None and c.save is None:
        notes.append(f"--save-interval {c.save_interval} without --save: no checkpoints are written "
                     "(Megatron-LM allows this too)")
    notes.extend(zero_weight_notes(config.data))
    docs, defaults = field_docs(KernelConfig), KernelConfig()
    for f in dataclasses.fields(KernelConfig):
        value = getattr(config.kernels, f.name)
        if value != getattr(defaults, f.name):
            flag = flag_name(f.name) if value is not False else "--no-" + f.name.replace("_", "-")
            shown = f"{flag} {value}" if not isinstance(value, bool) else flag
            doc = docs[f.name]
            notes.append(f"{shown}: accepted for Megatron-LM compatibility; {doc[0].lower()}{doc[1:]}")
    return notes


def check_device(config: DominoConfig, cuda: bool, cpu_fp16: bool = False) -> None:
    """Raises :class:`ConfigError` for precision or backend settings this machine cannot run.

    Args:
        config: the resolved configuration.
        cuda: whether CUDA GPUs are usable.
        cpu_fp16: whether DeepSpeed's CPU accelerator reports fp16 support (CPUs with AVX-512 FP16/AMX).
    """
    problems: List[str] = []
    _check(problems, cuda or cpu_fp16 or not config.train.fp16,
           "--fp16 needs a CUDA GPU: this machine has none and DeepSpeed's CPU accelerator reports no fp16 support "
           "here; drop --fp16 (fp32) or use --bf16")
    _check(problems, cuda or config.parallel.distributed_backend != "nccl",
           "--distributed-backend nccl needs CUDA GPUs, none here; use --distributed-backend gloo (the default "
           "without CUDA)")
    if problems:
        raise ConfigError("; ".join(problems))


def padded_vocab_size(vocab_size: int, config: DominoConfig) -> int:
    """Pads ``vocab_size`` to a multiple of ``--make-vocab-size-divisible-by`` x TP size, as Megatron does."""
    multiple = config.model.make_vocab_size_divisible_by * config.parallel.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
