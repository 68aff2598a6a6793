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

from domino.checkpoint import manifest, weights_io
from domino.config import ConfigError, DominoConfig
from domino.parallel import random as tp_random
from domino.runtime import state
from domino.runtime.agreement import AgreedFailure, agree

logger = logging.getLogger(__name__)

#: Model fields that must match between a checkpoint and the run loading it (the last ones decide which
#: parameters exist: learned position table, norm biases, linear biases, SwiGLU's gate, key/value heads, output).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_size", "num_positions", "rope",
                "normalization", "disable_bias_linear", "swiglu", "query_groups", "untie_embeddings_and_output_weights")


def _restore_rng_state(snapshot: Dict[str, Any]) -> None:
    kind, keys, pos, has_gauss, cached = snapshot["numpy"]
    snapshot["numpy"] = (kind, keys.numpy().astype("uint32"), pos, has_gauss, cached)
    tp_random.set_rng_state(snapshot)


def _restore_optimizer_state(engine, sd: Dict[str, Any]) -> None:
    optimizer = engine.optimizer
    live_scaler = getattr(optimizer, "loss_scaler", None)
    fields = sd.pop("loss_scaler_fields", None)
    if live_scaler is not None:
        for key, value in (fields or {}).items():
            setattr(live_scaler, key, value)
        sd["loss_scaler"] = live_scaler
    # ZeRO's and the BF16 optimizer's states (deepspeed 0.19.8: runtime/zero/stage_1_and_2.py, runtime/bf16_optimizer.py)
    # hold this DP rank's partition of the fp32 master weights; both load from a per-DP-rank list and must take
    # those fp32 weights (load_from_fp32_weights) or resuming would restart from the rounded bf16/fp16 weights.
    partitioned = "zero_stage" in sd or "single_partition_of_fp32_groups" in sd
    if "zero_stage" in sd:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        sd["zero_stage"] = ZeroStageEnum(sd["zero_stage"])
    if partitioned:
        sd["param_slice_mappings"] = getattr(optimizer, "_param_slice_mappings", None)
        state_list = [None] * state.get_data_parallel_world_size()
        state_list[state.get_data_parallel_rank()] = sd
        optimizer.load_state_dict(state_list, load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        optimizer.load_state_dict(sd)


def find_checkpoint(config: DominoConfig) -> Tuple[Optional[Path], bool]:
    """The checkpoint to start from and whether to take its weights only (a warm start).

    The run's own checkpoint comes first: when ``--save`` already holds one (a restarted pod, a retried
    step, the same command run again), it is resumed whatever ``--load`` names, so a restart never throws
    progress away and never reloads another run's model over its own. Otherwise ``--load DIR`` resumes from
    ``DIR/latest`` (with ``--finetune``: takes its weights as a warm start); an absent or empty ``DIR``, or
    one holding only what a run writes beside its checkpoints (metrics, logs), means a fresh start. Without
    ``--load`` a run starts fresh (as in Megatron-LM). Anything else that is not a readable checkpoint (a
    file, another kind of model) is a :class:`ConfigError`, raised before any training work.
    """
    c = config.checkpoint
    if c.load is None:
        return None, False
    if c.save and Path(c.save).resolve() != Path(c.load).resolve():
        own = _resolve(c.save, "--save", c.strict_load)
        if own is not None:
            logger.info("--save %s already holds this run's checkpoint %s: resuming it instead of %s --load %s",
                        c.save, own.name, "warm-starting from" if c.finetune else "loading", c.load)
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
    own = Path(save) / weights_io.checkpoint_tag(iteration)
    return str(own) if own.is_dir() and resumed.parent.resolve() == own.parent.resolve() else None


def _resolve(directory: str, flag: str, strict: bool = False) -> Optional[Path]:
    path = Path(directory)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    if path.is_dir() and not (path / "latest").exists() and not (path / "checkpoint.json").exists():
        if any(_checkpoints_below(path, None)):  # killed after the first rename in, before `latest` was written
            return _newest_complete(path, None, f"{flag} {directory} has no 'latest' file", strict)
        foreign = [p.name for p in path.iterdir() if _looks_like_a_model(p.name)]
        if not foreign:
            return None  # temporaries of a save that never completed, metrics or logs of a run not saved yet
        raise ConfigError(f"{flag} {directory}: not a domino checkpoint directory (no 'latest' file; found "
                          f"{', '.join(sorted(foreign)[:5])})")
    try:
        return weights_io.resolve_checkpoint_dir(path)
    except (ValueError, OSError) as error:
        try:
            pointed = weights_io.read_latest(path)
        except ValueError:
            pointed = None
        if pointed is not None and pointed.is_dir():
            return pointed  # a torn checkpoint that `latest` names: choose_intact judges it and falls back
        if pointed is not None:  # killed while a checkpoint of the same iteration was being replaced
            return _newest_complete(path, pointed.name, f"{flag} {directory}: 'latest' names {pointed.name}, "
                                    "which does not exist", strict)
        raise ConfigError(f"{flag} {directory}: {error}") from error


#: Names that mark another kind of model (Hugging Face, Megatron-LM, torch files), not a run's metrics or logs.
_MODEL_FILES = ("config.json", "latest_checkpointed_iteration.txt")
_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _looks_like_a_model(name: str) -> bool:
    return name in _MODEL_FILES or name.endswith(_MODEL_SUFFIXES)


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
        weights_io.read_checkpoint_meta(ckpt)
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
        diffs.append(f"padded vocabulary: checkpoint {meta['padded_vocab_size']} vs run {padded_vocab_size}")
    if diffs:
        raise ConfigError(f"--load {where}: the checkpoint's model has a different shape ({'; '.join(diffs)})")


#: Parameters with one row per vocabulary entry (the output layer exists only in a last pipeline stage).
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _model_weights(ckpt: Path, meta: Dict[str, Any], module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """This TP rank's weights from ``ckpt``, resharded and re-padded to ``module``'s vocabulary if needed."""
    from domino.checkpoint import sharding

    tp_rank, tp = state.get_tensor_model_parallel_rank(), state.get_tensor_model_parallel_world_size()
    local = module.state_dict().get(VOCAB_ROWS[0])
    rows = local.shape[0] * tp if local is not None else meta["padded_vocab_size"]
    if meta["padded_vocab_size"] == rows:
        return weights_io.load_model_shard(ckpt, tp_rank, tp)
    logger.info("re-padding the vocabulary from %d to %d rows", meta["padded_vocab_size"], rows)
    full = weights_io.load_full_state_dict(ckpt)
    for name in VOCAB_ROWS:
        if name in full:
            weight = full[name][:rows]
            padding = weight.new_zeros((rows - weight.shape[0], *weight.shape[1:]))
            full[name] = torch.cat([weight, padding])
    return sharding.shard_state_dict(full, tp_rank, tp)


def _files_to_read(meta: Dict[str, Any], config: DominoConfig, weights_only: bool) -> list:
    """The checkpoint files this rank reads when loading (names relative to the checkpoint)."""
    tp, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    saved_tp = meta["tensor_model_parallel_size"]
    shards = [tp_rank] if saved_tp == tp else range(saved_tp)
    names = [f"{weights_io.MODEL_DIR}/{weights_io.shard_file_name(r)}" for r in shards]
    rank = dist.get_rank() if dist.is_initialized() else 0
    c = config.checkpoint
    if not weights_only and not c.no_load_optim:
        names.append(f"optim/rank_{rank:05d}.pt")
    if not weights_only and not c.no_load_rng:
        names.append(f"rng/rank_{rank:05d}.pt")
    return names


def _verified(ckpt: Path, config: DominoConfig, weights_only: bool) -> Tuple[Path, Dict[str, Any]]:
    """``ckpt`` and its metadata once every rank has checked the checksums of the files it will read; else
    an intact older one.

    Each rank verifies only its own files, then all ranks agree, so they reach one outcome: all load
    ``ckpt``, all fall back to the same older checkpoint, or all stop with the same message.
    """
    while True:
        def check() -> Dict[str, Any]:
            meta = weights_io.read_checkpoint_meta(ckpt)
            problem = manifest.verify(ckpt, _files_to_read(meta, config, weights_only))
            if problem:
                raise ConfigError(problem)
            return meta

        try:
            return ckpt, agree(f"verifying checkpoint {ckpt.name}", check)
        except AgreedFailure as failure:
            ckpt = _fall_back(ckpt, str(failure), config.checkpoint.strict_load)


def resumed_zero_stage(ckpt: Optional[Path], config: DominoConfig, weights_only: bool) -> Optional[int]:
    """The ZeRO stage of the optimizer state this run would resume from ``ckpt``; ``None`` when it resumes none.

    A stage-0 optimizer state is torch AdamW's (per parameter), a stage 1/2 one DeepSpeed's ZeRO partitions: the
    run must use a stage of the same kind to load it (:func:`_read_state` refuses otherwise).
    """
    if ckpt is None or weights_only or config.checkpoint.no_load_optim or not (ckpt / "optim").is_dir():
        return None
    try:
        return weights_io.read_checkpoint_meta(ckpt)["config"]["parallel"]["zero_stage"]
    except (weights_io.CheckpointError, OSError, KeyError, TypeError):
        return None  # a damaged checkpoint: _verified reports it (or falls back) when loading


def _read_state(ckpt: Path, meta: Dict[str, Any], engine, config: DominoConfig, padded_vocab_size: int,
                weights_only: bool) -> Tuple[Dict[str, torch.Tensor], Optional[dict], Optional[dict]]:
    """This rank's model weights, optimizer state and RNG state from ``ckpt`` (read only, nothing applied)."""
    check_compatible(meta, config, padded_vocab_size, ckpt, warm_start=weights_only)
    weights = _model_weights(ckpt, meta, engine.module)
    if weights_only or not (ckpt / "optim").is_dir():
        return weights, None, None
    tp, dp = state.get_tensor_model_parallel_world_size(), state.get_data_parallel_world_size()
    same_layout = meta["tensor_model_parallel_size"] == tp and meta.get("data_parallel_size") == dp
    rank = dist.get_rank() if dist.is_initialized() else 0
    c, optim, rng = config.checkpoint, None, None
    if not c.no_load_optim:
        if not same_layout:
            raise ConfigError(
                f"--load {ckpt}: saved with TP={meta['tensor_model_parallel_size']} x DP={meta.get('data_parallel_size')}"
                f", this run is TP={tp} x DP={dp}; the optimizer state cannot be resharded. Use --finetune or "
                "--no-load-optim to take the weights only.")
        saved_stage = meta["config"]["parallel"].get("zero_stage")
        stage = config.parallel.zero_stage
        if saved_stage is not None and (saved_stage == 0) != (stage == 0):
            raise ConfigError(
                f"--load {ckpt}: its optimizer state is from --zero-stage {saved_stage}, this run uses --zero-stage "
                f"{stage} (a plain and a ZeRO optimizer save different states); resume with --zero-stage "
                f"{saved_stage} (or without --zero-stage), or use --no-load-optim to take the weights only.")
        optim = torch.load(ckpt / "optim" / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=True)
    if not c.no_load_rng and same_layout:
        rng = torch.load(ckpt / "rng" / f"rank_{rank:05d}.pt", weights_only=True)
    return weights, optim, rng


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
    engine.module.load_state_dict(weights, strict=True)
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()  # ZeRO keeps its own fp32 master copy of the weights
    if weights_only:
        logger.info("warm start from %s (weights only, iteration 0)", ckpt)
        return 0, 0
    if not (ckpt / "optim").is_dir():
        logger.info("%s holds weights only (no optimizer or RNG state): continuing with a fresh optimizer", ckpt)
        return meta["iteration"], meta["consumed_samples"]
    if optim is not None:
        _restore_optimizer_state(engine, optim)
    if rng is not None:
        _restore_rng_state(rng)
    logger.info("resumed from %s at iteration %d (%d samples consumed)", ckpt, meta["iteration"],
                meta["consumed_samples"])
    return meta["iteration"], meta["consumed_samples"]
