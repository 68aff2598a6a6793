"""Resuming a training run: choosing an intact checkpoint, verifying it on every rank, loading it.

The counterpart of :mod:`domino.checkpoint.checkpointing` (same layout). ``--load DIR`` resumes from
``DIR/latest``; a damaged checkpoint falls back to the newest intact one (``--strict-load`` refuses), and
every rank verifies and reads its files before anything is applied, in agreements, so all ranks reach one
outcome. Loading uses ``torch.load(weights_only=True)`` and safetensors: nothing arbitrary is unpickled.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from domino.checkpoint import distributed_io, manifest, optimizer_state, per_rank_state, on_disk
from domino.checkpoint.checkpointing import collective
from domino.config import ConfigError, DominoConfig
from domino.runtime import state
from domino.runtime.agreement import AgreedFailure, agree

logger = logging.getLogger(__name__)

#: Model fields that must match between a checkpoint and the run loading it (the last ones decide which
#: parameters exist: learned position table, norm biases, linear biases, SwiGLU's gate, key/value heads, output).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_size", "num_positions", "rope",
                "normalization", "disable_bias_linear", "swiglu", "query_groups", "untie_embeddings_and_output_weights")


def find_checkpoint(config: DominoConfig) -> Tuple[Optional[Path], bool]:
    """The checkpoint to start from and whether to take its weights only (a warm start).

    ``--load DIR`` resumes from ``DIR/latest``; an absent or empty ``DIR`` means a fresh start. With
    ``--finetune`` the weights of ``--load`` are a warm start, unless ``--save`` already holds a checkpoint
    of this run (a restarted pod of a warm-started job): then that checkpoint is resumed, so a restart
    never throws progress away. Anything that is not a readable checkpoint (a file, a ``latest`` pointing
    nowhere, a directory of unrelated files) is a :class:`ConfigError`, raised before any training work.
    """
    c = config.checkpoint
    if c.load is None:
        return None, False
    if c.finetune and c.save and Path(c.save).resolve() != Path(c.load).resolve():
        own = _resolve(c.save, "--save", c.strict_load)
        if own is not None:
            logger.info("--save %s already holds this run's checkpoint %s: resuming it instead of warm-starting "
                        "from --load", c.save, own.name)
            return choose_intact(own, c.strict_load), False
    found = _resolve(c.load, "--load", c.strict_load)
    return (choose_intact(found, c.strict_load) if found is not None else None), c.finetune


def own_checkpoint(config: DominoConfig, resumed: Optional[Path], warm_start: bool, iteration: int) -> Optional[str]:
    """The checkpoint of ``iteration`` under ``--save`` that the run resumed (from ``resumed``'s folder), if any.

    The training loop does not save that iteration again (a restart after the last iteration saves nothing).
    """
    save = config.checkpoint.save
    if resumed is None or warm_start or not save:
        return None
    own = Path(save) / on_disk.checkpoint_tag(iteration)
    return str(own) if own.is_dir() and resumed.parent.resolve() == own.parent.resolve() else None


def _resolve(directory: str, flag: str, strict: bool = False) -> Optional[Path]:
    path = Path(directory)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    if path.is_dir() and not (path / "latest").exists() and not (path / "checkpoint.json").exists():
        if any(_checkpoints_below(path, None)):  # killed after the first rename in, before `latest` was written
            return _newest_complete(path, None, f"{flag} {directory} has no 'latest' file", strict)
        leftovers = [p.name for p in path.iterdir() if not p.name.startswith(".")]
        if not leftovers:
            return None  # only temporaries of a save that never completed
        raise ConfigError(f"{flag} {directory}: not a domino checkpoint directory (no 'latest' file; found "
                          f"{', '.join(sorted(leftovers)[:5])})")
    try:
        return on_disk.resolve_checkpoint_dir(path)
    except (ValueError, OSError) as error:
        try:
            pointed = on_disk.read_latest(path)
        except ValueError:
            pointed = None
        if pointed is not None and pointed.is_dir():
            return pointed  # a torn checkpoint that `latest` names: choose_intact judges it and falls back
        if pointed is not None:  # killed while a checkpoint of the same iteration was being replaced
            return _newest_complete(path, pointed.name, f"{flag} {directory}: 'latest' names {pointed.name}, "
                                    "which does not exist", strict)
        raise ConfigError(f"{flag} {directory}: {error}") from error


def _checkpoints_below(root: Path, tag: Optional[str]):
    """The ``iter_*`` directories of ``root`` before ``tag`` (all of them for ``None``), newest first."""
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_")
                   and (tag is None or p.name < tag)), key=lambda p: p.name, reverse=True)


def _newest_complete(root: Path, below: Optional[str], problem: str, strict: bool) -> Path:
    """The newest intact checkpoint of ``root`` (before ``below``), when ``latest`` cannot be followed."""
    if strict:
        raise ConfigError(f"{problem} (--strict-load refuses to fall back)")
    for ckpt in _checkpoints_below(root, below):
        if _damage(ckpt) is None:
            logger.warning("%s: resuming from the newest complete checkpoint, %s (pass --strict-load to refuse "
                           "instead).", problem, ckpt.name)
            return ckpt
    raise ConfigError(f"{problem}, and no complete checkpoint exists in {root}")


def _older_checkpoints(ckpt: Path):
    """The checkpoints beside ``ckpt`` with a lower iteration, newest first."""
    return _checkpoints_below(ckpt.parent, ckpt.name)


def _damage(ckpt: Path) -> Optional[str]:
    """Why ``ckpt`` cannot be resumed, from its metadata, manifest and file sizes (no data read)."""
    try:
        on_disk.read_checkpoint_meta(ckpt)
    except ValueError as error:
        return str(error)
    return manifest.find_damage(ckpt)


def _fall_back(ckpt: Path, problem: str, strict: bool) -> Path:
    """The newest intact checkpoint older than the damaged ``ckpt``, or a ConfigError when there is none.

    Every rank reaches the same answer: the candidates and their sizes come from the same shared volume.
    """
    if strict:
        raise ConfigError(f"--load: checkpoint {ckpt} is damaged: {problem} (--strict-load refuses to fall back)")
    for older in _older_checkpoints(ckpt):
        if _damage(older) is None:
            logger.warning("CHECKPOINT %s IS DAMAGED: %s. Resuming from the newest intact checkpoint, %s "
                           "(pass --strict-load to refuse instead).", ckpt, problem, older.name)
            return older
    raise ConfigError(f"--load: checkpoint {ckpt} is damaged ({problem}) and no older intact checkpoint exists "
                      f"in {ckpt.parent}")


def choose_intact(ckpt: Path, strict: bool) -> Path:
    """``ckpt`` when its files are all present at their recorded sizes, else the newest intact older one."""
    problem = _damage(ckpt)
    return ckpt if problem is None else _fall_back(ckpt, problem, strict)


def check_compatible(meta: Dict[str, Any], config: DominoConfig, padded_vocab_size: int, where: Path,
                     warm_start: bool = False) -> None:
    """Raises :class:`ConfigError` when the checkpoint's model cannot be loaded into this run's model.

    A warm start may differ in vocabulary padding only (TP=2 pads GPT-2's vocabulary to 50432 rows, TP=1
    to 50304): the padding rows are dropped or added when the weights are loaded.
    """
    from domino.config import config_from_dict

    saved = config_from_dict(meta["config"]).model
    # Rotary positions have no table: a rope model loads into a run with more (or fewer) positions, which is how
    # a context is extended.
    fields = [name for name in SHAPE_FIELDS if not (name == "num_positions" and saved.rope and config.model.rope)]
    diffs = [f"{name}: checkpoint {getattr(saved, name)} vs run {getattr(config.model, name)}"
             for name in fields if getattr(saved, name) != getattr(config.model, name)]
    if meta["padded_vocab_size"] != padded_vocab_size and not warm_start:
        diffs.append(f"padded vocabulary: checkpoint {meta['padded_vocab_size']} vs run {padded_vocab_size}"
                     f"{_padding_hint(meta, config)}")
    if diffs:
        raise ConfigError(f"--load {where}: the checkpoint's model has a different shape ({'; '.join(diffs)})")


def _padding_hint(meta: Dict[str, Any], config: DominoConfig) -> str:
    """How to keep a checkpoint's vocabulary padding on another TP size (its rows take part in the softmax, so
    a resume cannot drop or add them and continue the same losses)."""
    try:
        saved = meta["config"]["model"]["make_vocab_size_divisible_by"] * meta["tensor_model_parallel_size"]
    except (KeyError, TypeError):
        return ""
    tp = config.parallel.tensor_model_parallel_size
    if saved % tp:
        return f" (TP={tp} cannot keep it: the padding multiple {saved} is not divisible by {tp})"
    return f" (to keep it at TP={tp}: --make-vocab-size-divisible-by {saved // tp})"


#: Parameters with one row per vocabulary entry (the output layer exists only in a last pipeline stage).
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _model_weights(ckpt: Path, meta: Dict[str, Any], module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """This TP rank's weights from ``ckpt``, resharded and re-padded to ``module``'s vocabulary if needed."""
    from domino.checkpoint import sharding

    tp_rank, tp = state.get_tensor_model_parallel_rank(), state.get_tensor_model_parallel_world_size()
    local = module.state_dict().get(VOCAB_ROWS[0])
    rows = local.shape[0] * tp if local is not None else meta["padded_vocab_size"]
    if meta["padded_vocab_size"] == rows:
        return on_disk.load_model_shard(ckpt, tp_rank, tp)
    logger.info("re-padding the vocabulary from %d to %d rows", meta["padded_vocab_size"], rows)
    full = on_disk.load_full_state_dict(ckpt)
    for name in VOCAB_ROWS:
        if name in full:
            weight = full[name][:rows]
            padding = weight.new_zeros((rows - weight.shape[0], *weight.shape[1:]))
            full[name] = torch.cat([weight, padding])
    return sharding.shard_state_dict(full, tp_rank, tp)


def optimizer_format(ckpt: Path, meta: Dict[str, Any]) -> Optional[str]:
    """How ``ckpt`` stores optimizer state: ``"by-name"`` (any layout), ``"per-rank"`` (format 1: the layout
    that wrote it), or ``None`` (weights only: ``import-hf`` output)."""
    recorded = meta.get("optimizer")
    if isinstance(recorded, dict) and recorded.get("format") in ("by-name", "per-rank"):
        return recorded["format"]
    return "per-rank" if (ckpt / on_disk.LEGACY_OPTIMIZER_DIR).is_dir() else None


def _same_layout(meta: Dict[str, Any]) -> bool:
    return (meta["tensor_model_parallel_size"] == state.get_tensor_model_parallel_world_size()
            and meta.get("data_parallel_size") == state.get_data_parallel_world_size())


def _files_to_read(ckpt: Path, meta: Dict[str, Any], config: DominoConfig, weights_only: bool) -> list:
    """The checkpoint files this rank verifies before loading (names relative to the checkpoint).

    The optimizer state by name is read by whichever ranks need each slice, so its files are verified once,
    spread over the ranks (rank r takes every world-size-th file); the agreement after the check makes each
    verdict every rank's.
    """
    tp, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    saved_tp = meta["tensor_model_parallel_size"]
    shards = [tp_rank] if saved_tp == tp else range(saved_tp)
    names = [f"{on_disk.MODEL_DIR}/{on_disk.shard_file_name(r)}" for r in shards]
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    c, kind = config.checkpoint, optimizer_format(ckpt, meta)
    if weights_only or kind is None:
        return names
    if not c.no_load_optim and kind == "by-name":
        stored = distributed_io.files(ckpt / on_disk.OPTIMIZER_DIR)
        names += [f"{on_disk.OPTIMIZER_DIR}/{p.name}" for p in stored[rank::world]]
    elif not c.no_load_optim:
        names.append(f"{on_disk.LEGACY_OPTIMIZER_DIR}/rank_{rank:05d}.pt")
    if not c.no_load_rng and _same_layout(meta):
        names.append(f"{on_disk.RNG_DIR}/rank_{rank:05d}.pt")
    return names


def _verified(ckpt: Path, config: DominoConfig, weights_only: bool) -> Tuple[Path, Dict[str, Any]]:
    """``ckpt`` and its metadata once every rank has checked the checksums of the files it will read; else
    an intact older one.

    Each rank verifies only its own files, then all ranks agree, so they reach one outcome: all load
    ``ckpt``, all fall back to the same older checkpoint, or all stop with the same message.
    """
    while True:
        def check() -> Dict[str, Any]:
            meta = on_disk.read_checkpoint_meta(ckpt)
            problem = manifest.verify(ckpt, _files_to_read(ckpt, meta, config, weights_only))
            if problem:
                raise ConfigError(problem)
            return meta

        try:
            return ckpt, agree(f"verifying checkpoint {ckpt.name}", check)
        except AgreedFailure as failure:
            ckpt = _fall_back(ckpt, str(failure), config.checkpoint.strict_load)


def resumed_zero_stage(ckpt: Optional[Path], config: DominoConfig, weights_only: bool) -> Optional[int]:
    """The ZeRO stage of the optimizer state this run would resume from ``ckpt``; ``None`` when it resumes none.

    Without ``--zero-stage`` a resumed run keeps its checkpoint's stage (any stage reads a state stored by name;
    a per-rank state of format 1 only a stage of its own kind, :func:`_check_per_rank`).
    """
    if ckpt is None or weights_only or config.checkpoint.no_load_optim:
        return None
    try:
        meta = on_disk.read_checkpoint_meta(ckpt)
        return meta["config"]["parallel"]["zero_stage"] if optimizer_format(ckpt, meta) else None
    except (on_disk.CheckpointError, OSError, KeyError, TypeError):
        return None  # a damaged checkpoint: _verified reports it (or falls back) when loading


def check_resumable(ckpt: Optional[Path], config: DominoConfig, data_parallel_size: int, weights_only: bool,
                    padded_vocab_size: int) -> None:
    """Refuses, in one line and before anything is built, a checkpoint this run cannot continue exactly.

    The model's shape and padded vocabulary must match (:func:`check_compatible`). The data position (consumed
    samples) and the learning-rate schedule count whole global batches; another ``--global-batch-size`` would
    continue neither exactly. The micro-batch size and the layout may change: each global batch holds the same
    samples, split otherwise.
    """
    if ckpt is None:
        return
    meta = on_disk.read_checkpoint_meta(ckpt)
    check_compatible(meta, config, padded_vocab_size, ckpt, warm_start=weights_only)
    if weights_only:
        return
    saved = meta.get("global_batch_size")
    if saved is None:  # format 1: derive it from the saved settings
        train = meta["config"].get("train", {})
        saved = train.get("global_batch_size") or train.get("micro_batch_size", 0) * meta.get("data_parallel_size", 1)
    run = config.train.global_batch_size or config.train.micro_batch_size * data_parallel_size
    if saved and saved != run:
        raise ConfigError(f"--load {ckpt}: saved with a global batch of {saved} samples, this run's is {run} "
                          f"(--global-batch-size); its data position and schedule count batches of {saved}: "
                          f"resume with --global-batch-size {saved}, or warm-start with --finetune")


def _check_per_rank(ckpt: Path, meta: Dict[str, Any], config: DominoConfig) -> None:
    """Refuses to load format 1's per-rank optimizer state on another layout or another kind of optimizer."""
    tp, dp = state.get_tensor_model_parallel_world_size(), state.get_data_parallel_world_size()
    if not _same_layout(meta):
        raise ConfigError(
            f"--load {ckpt}: its optimizer state is per rank (format {meta['format_version']}), saved with "
            f"TP={meta['tensor_model_parallel_size']} x DP={meta.get('data_parallel_size')}, this run is TP={tp} x "
            f"DP={dp}; resume it once on its own layout (the next save stores the state by name, which any layout "
            "reads), or use --no-load-optim to take the weights only")
    saved_stage = meta["config"]["parallel"].get("zero_stage")
    stage = config.parallel.zero_stage
    if saved_stage is not None and (saved_stage == 0) != (stage == 0):
        raise ConfigError(
            f"--load {ckpt}: its optimizer state is from --zero-stage {saved_stage}, this run uses --zero-stage "
            f"{stage} (a plain and a ZeRO optimizer save different per-rank states); resume with --zero-stage "
            f"{saved_stage} (or without --zero-stage), or use --no-load-optim to take the weights only.")


def _read_state(ckpt: Path, meta: Dict[str, Any], engine, config: DominoConfig, padded_vocab_size: int,
                weights_only: bool) -> Tuple[Dict[str, torch.Tensor], Optional[dict], Optional[dict]]:
    """This rank's model weights, per-rank optimizer state and RNG state from ``ckpt`` (nothing applied; the
    optimizer state by name is read afterwards, by all ranks together)."""
    check_compatible(meta, config, padded_vocab_size, ckpt, warm_start=weights_only)
    weights = _model_weights(ckpt, meta, engine.module)
    kind = optimizer_format(ckpt, meta)
    if weights_only or kind is None:
        return weights, None, None
    rank = dist.get_rank() if dist.is_initialized() else 0
    c, optim, rng = config.checkpoint, None, None
    if not c.no_load_optim and kind == "per-rank":
        _check_per_rank(ckpt, meta, config)
        optim = torch.load(ckpt / on_disk.LEGACY_OPTIMIZER_DIR / f"rank_{rank:05d}.pt", map_location="cpu",
                           weights_only=True)
    elif not c.no_load_optim and not optimizer_state.supports(engine):
        raise ConfigError(f"--load {ckpt}: this run's optimizer (--fp16 without ZeRO) cannot take an optimizer "
                          "state stored by name; resume with --zero-stage 1, or use --no-load-optim")
    elif not c.no_load_optim:
        optimizer_state.Scalars.from_json(meta["optimizer"], str(ckpt / on_disk.META_FILE))
    if not c.no_load_rng and _same_layout(meta):
        rng = torch.load(ckpt / on_disk.RNG_DIR / f"rank_{rank:05d}.pt", weights_only=True)
    return weights, optim, rng


def _read_optimizer_by_name(ckpt: Path, engine):
    """Every rank's slices of the optimizer state stored by name (collective: DCP plans and reads together)."""
    tensors = optimizer_state.empty_like_state(engine)
    distributed_io.load(ckpt / on_disk.OPTIMIZER_DIR, tensors)
    return tensors


def load_checkpoint(engine, config: DominoConfig, ckpt: Path, padded_vocab_size: int,
                    weights_only: bool = False) -> Tuple[int, int]:
    """Checks that ``ckpt`` fits this run, then restores model, optimizer and RNG state into this rank.

    Every rank first verifies and reads what it needs; only when all ranks succeeded (an agreement) is
    anything applied, so a file that fails on one rank stops every rank with the same message.

    Args:
        padded_vocab_size: this run's padded vocabulary (see :func:`check_compatible`).
        weights_only: a warm start (``--finetune``): take the weights, keep the fresh optimizer and RNG.

    Returns:
        ``(iteration, consumed_samples)`` to continue from; ``(0, 0)`` for a warm start.
    """
    ckpt, meta = _verified(ckpt, config, weights_only)
    weights, optim, rng = agree(f"reading checkpoint {ckpt}", lambda: _read_state(
        ckpt, meta, engine, config, padded_vocab_size, weights_only))
    kind = optimizer_format(ckpt, meta)
    by_name = None
    if kind == "by-name" and not weights_only and not config.checkpoint.no_load_optim:
        by_name = collective(f"reading the optimizer state of {ckpt}", lambda: _read_optimizer_by_name(ckpt, engine))
    engine.module.load_state_dict(weights, strict=True)
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()  # ZeRO keeps its own fp32 master copy of the weights
    if weights_only:
        logger.info("warm start from %s (weights only, iteration 0)", ckpt)
        return 0, 0
    if kind is None:
        logger.info("%s holds weights only (no optimizer or RNG state): continuing with a fresh optimizer", ckpt)
        return meta["iteration"], meta["consumed_samples"]
    if by_name is not None:  # after the weights: the master weights are the checkpoint's, not rounded copies
        optimizer_state.scatter(engine, by_name, optimizer_state.Scalars.from_json(meta["optimizer"], str(ckpt)))
    if optim is not None:
        per_rank_state.restore_optimizer(engine, optim)
    if rng is not None:
        per_rank_state.restore_rng(rng)
    logger.info("resumed from %s at iteration %d (%d samples consumed)", ckpt, meta["iteration"],
                meta["consumed_samples"])
    return meta["iteration"], meta["consumed_samples"]
