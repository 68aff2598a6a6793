"""All config validation, in one place, with errors that name the flags involved."""

from __future__ import annotations

from typing import List, Optional

from domino.config.schema import DominoConfig


class ConfigError(ValueError):
    """A setting (or a combination of settings) that cannot work; the message names the flags."""


def _check(problems: List[str], ok: bool, message: str) -> None:
    if not ok:
        problems.append(message)


def data_parallel_size(config: DominoConfig, world_size: int) -> int:
    """Number of data-parallel replicas for ``world_size`` processes."""
    return world_size // config.parallel.tensor_model_parallel_size


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
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
        value = getattr(m, name)
        _check(problems, value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}")
    _check(problems, tp >= 1, f"--tensor-model-parallel-size must be >= 1, got {tp}")
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
    if m.vocab_size is not None:
        _check(problems, m.vocab_size >= 1, f"--vocab-size must be >= 1, got {m.vocab_size}")
    for name in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, name)
        _check(problems, 0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
    _check(problems, m.init_method_std > 0, f"--init-method-std must be > 0, got {m.init_method_std}")

    _check(problems, p.domino_chunks >= 1, f"--domino-chunks must be >= 1, got {p.domino_chunks}")
    _check(problems, t.micro_batch_size % max(p.domino_chunks, 1) == 0,
           f"--micro-batch-size {t.micro_batch_size} is not divisible by --domino-chunks {p.domino_chunks} "
           "(Domino splits each micro-batch along the batch dimension)")
    _check(problems, p.zero_stage in (0, 1, 2), f"--zero-stage must be 0, 1 or 2, got {p.zero_stage}")
    _check(problems, p.distributed_backend in (None, "gloo", "nccl"),
           f"--distributed-backend must be gloo or nccl, got {p.distributed_backend!r}")

    _check(problems, t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}")
    _check(problems, not (t.fp16 and t.bf16), "--fp16 and --bf16 are mutually exclusive")
    _check(problems, not (t.train_iters is not None and t.train_samples is not None),
           "--train-iters and --train-samples are mutually exclusive")
    _check(problems, t.lr_decay_style in ("constant", "linear", "cosine"),
           f"--lr-decay-style must be constant, linear or cosine, got {t.lr_decay_style!r}")
    _check(problems, t.lr >= 0 and t.min_lr >= 0 and t.min_lr <= t.lr,
           f"need 0 <= --min-lr ({t.min_lr}) <= --lr ({t.lr})")
    _check(problems, t.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {t.lr_warmup_iters}")
    if t.lr_warmup_fraction is not None:
        _check(problems, 0.0 <= t.lr_warmup_fraction <= 1.0,
               f"--lr-warmup-fraction must be in [0, 1], got {t.lr_warmup_fraction}")
        _check(problems, t.lr_warmup_iters == 0, "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive")
    _check(problems, 0.0 <= t.adam_beta1 < 1.0 and 0.0 <= t.adam_beta2 < 1.0, "--adam-beta1/2 must be in [0, 1)")
    _check(problems, t.clip_grad >= 0, f"--clip-grad must be >= 0, got {t.clip_grad}")
    _check(problems, t.max_nan_steps >= 1, f"--max-nan-steps must be >= 1, got {t.max_nan_steps}")
    _check(problems, t.eval_interval >= 0 and t.eval_iters >= 0, "--eval-interval and --eval-iters must be >= 0")

    if world_size is not None:
        if world_size % tp != 0:
            problems.append(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}")
        else:
            dp = data_parallel_size(config, world_size)
            if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp) != 0:
                problems.append(
                    f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                    f"{t.micro_batch_size} x data-parallel size {dp}")

    _check(problems, c.save_interval is None or c.save_interval >= 1,
           f"--save-interval must be >= 1, got {c.save_interval}")
    _check(problems, c.keep_last is None or c.keep_last >= 1, f"--keep-last must be >= 1, got {c.keep_last}")
    _check(problems, lg.log_interval >= 1, f"--log-interval must be >= 1, got {lg.log_interval}")
    _check(problems, lg.timing_log_level in (0, 1, 2), f"--timing-log-level must be 0, 1 or 2, got {lg.timing_log_level}")
    _check(problems, d.num_workers >= 0, f"--num-workers must be >= 0, got {d.num_workers}")

    if for_training:
        _check(problems, t.train_iters is not None or t.train_samples is not None,
               "one of --train-iters or --train-samples is required")
        _check(problems, bool(d.data_path or d.train_data_path or d.mock_data),
               "no training data: give --data-path (or --train-data-path), or --mock-data")
        _check(problems, not (d.data_path and d.train_data_path),
               "--data-path and --train-data-path are mutually exclusive")
        _check(problems, c.save_interval is None or c.save is not None, "--save-interval needs --save")
        _check(problems, not (c.finetune and c.load is None), "--finetune needs --load")

    if problems:
        raise ConfigError("; ".join(problems))


def padded_vocab_size(vocab_size: int, config: DominoConfig) -> int:
    """Pads ``vocab_size`` to a multiple of ``--make-vocab-size-divisible-by`` x TP size, as Megatron does."""
    multiple = config.model.make_vocab_size_divisible_by * config.parallel.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
