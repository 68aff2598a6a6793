"""Atomic training checkpoints: model shards, ZeRO optimizer state, RNG states, position in the data.

Layout of a save root (model weights and ``checkpoint.json`` are ``domino.model.weights_io``'s format)::

    DIR/latest                         tag of the newest complete checkpoint, replaced last, atomically
    DIR/iter_0000100/checkpoint.json   iteration, consumed samples, TP size, padded vocab, resolved config
    DIR/iter_0000100/model/            one safetensors file per TP rank
    DIR/iter_0000100/optim/rank_00003.pt   this rank's optimizer (ZeRO partition) state
    DIR/iter_0000100/rng/rank_00003.pt     this rank's RNG states
    DIR/iter_0000100/tokenizer/        the tokenizer, so the checkpoint is self-contained

Every rank writes into ``DIR/.tmp-iter_0000100``; after a barrier rank 0 renames it into place and only
then moves ``latest``. A kill at any moment therefore leaves the previous checkpoint intact and pointed to.
Loading uses ``torch.load(weights_only=True)``: optimizer states are saved as plain tensors and numbers.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from domino.atomic_files import atomic_write, fsync_directory
from domino.checkpoint import manifest
from domino.config import ConfigError, DominoConfig, config_to_dict
from domino.model import weights_io
from domino.parallel import random as tp_random
from domino.parallel import state

logger = logging.getLogger(__name__)

#: Model fields that must match between a checkpoint and the run loading it.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_size", "num_positions")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_torch_save(obj: Any, path: Path) -> None:
    with atomic_write(str(path)) as handle:
        torch.save(obj, handle)


def _maybe_inject_fault(point: str, iteration: int) -> None:
    """Test hook: ``DOMINO_FAULT_INJECT=kill-in-save@N`` SIGKILLs rank 0 halfway through saving iteration N.

    The kill/resume tests use it to prove that a save cut short never damages the previous checkpoint.
    """
    spec = os.environ.get("DOMINO_FAULT_INJECT", "")
    if spec == f"{point}@{iteration}" and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("fault injection: killing this process in %s at iteration %d", point, iteration)
        os.kill(os.getpid(), signal.SIGKILL)


def _plain_rng_state() -> Dict[str, Any]:
    """All RNG states with numpy's array turned into a tensor (loadable with ``weights_only=True``)."""
    snapshot = dict(tp_random.get_rng_state())
    kind, keys, pos, has_gauss, cached = snapshot.pop("numpy")
    snapshot["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return snapshot


def _restore_rng_state(snapshot: Dict[str, Any]) -> None:
    kind, keys, pos, has_gauss, cached = snapshot["numpy"]
    snapshot["numpy"] = (kind, keys.numpy().astype("uint32"), pos, has_gauss, cached)
    tp_random.set_rng_state(snapshot)


def _plain_optimizer_state(engine) -> Dict[str, Any]:
    """The optimizer's state dict reduced to tensors, numbers, strings and containers of them.

    DeepSpeed's ZeRO state holds a loss-scaler object, an enum and slice-mapping objects; keeping them
    out lets loading use ``weights_only=True`` (no arbitrary unpickling).
    """
    sd = dict(engine.optimizer.state_dict())
    scaler = sd.pop("loss_scaler", None)
    if scaler is not None:
        sd["loss_scaler_fields"] = {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}
    sd.pop("param_slice_mappings", None)
    for key, value in list(sd.items()):
        if isinstance(value, enum.Enum):
            sd[key] = value.value
    return sd


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


def save_checkpoint(engine, config: DominoConfig, iteration: int, consumed_samples: int,
                    padded_vocab_size: int, tokenizer=None) -> Path:
    """Writes checkpoint ``iter_{iteration:07d}`` under ``--save`` from every rank (collective).

    Returns:
        The final checkpoint directory.
    """
    root = Path(config.checkpoint.save)
    tag = weights_io.checkpoint_tag(iteration)
    tmp, final = root / f".tmp-{tag}", root / tag
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a run killed mid-save
        (tmp / "optim").mkdir(parents=True)
        (tmp / "rng").mkdir()
    _barrier()
    written = [tmp / "optim" / f"rank_{rank:05d}.pt", tmp / "rng" / f"rank_{rank:05d}.pt"]
    if state.get_data_parallel_rank() == 0:
        written.append(weights_io.save_model_shard(tmp, engine.module.state_dict(),
                                                   state.get_tensor_model_parallel_rank()))
    _atomic_torch_save(_plain_optimizer_state(engine), written[0])
    _atomic_torch_save(_plain_rng_state(), written[1])
    manifest.write_part(tmp, rank, written)  # each rank digests its own files: the work is spread
    if rank == 0:
        meta = {
            "format_version": 1, "iteration": iteration, "consumed_samples": consumed_samples,
            "tensor_model_parallel_size": state.get_tensor_model_parallel_world_size(),
            "data_parallel_size": state.get_data_parallel_world_size(),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "padded_vocab_size": padded_vocab_size, "tokenizer": config.data.tokenizer,
            "config": config_to_dict(config),
        }
        weights_io.write_checkpoint_meta(tmp, meta)
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer"))
    _barrier()
    _maybe_inject_fault("kill-in-save", iteration)
    if rank == 0:
        manifest.seal(tmp)  # before the rename: a checkpoint under its final name has its manifest
        for sub in ("", "optim", "rng", "model"):
            if (tmp / sub).exists():
                fsync_directory(tmp / sub)
        if final.exists():  # the same iteration saved again after a resume: replace it whole
            trash = root / f".trash-{tag}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            shutil.rmtree(trash)
        os.replace(tmp, final)
        fsync_directory(root)
        weights_io.write_latest(root, tag)
        _prune(root, config.checkpoint.keep_last, keep=tag)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def _prune(root: Path, keep_last: Optional[int], keep: str) -> None:
    if not keep_last:
        return
    tags = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_"))
    for tag in tags[:-keep_last]:
        if tag != keep:
            shutil.rmtree(root / tag, ignore_errors=True)


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
        own = _resolve(c.save, "--save")
        if own is not None:
            logger.info("--save %s already holds this run's checkpoint %s: resuming it instead of warm-starting "
                        "from --load", c.save, own.name)
            return choose_intact(own, c.strict_load), False
    found = _resolve(c.load, "--load")
    return (choose_intact(found, c.strict_load) if found is not None else None), c.finetune


def _resolve(directory: str, flag: str) -> Optional[Path]:
    path = Path(directory)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    if path.is_dir() and not (path / "latest").exists() and not (path / "checkpoint.json").exists():
        leftovers = [p.name for p in path.iterdir() if not p.name.startswith(".")]
        if not leftovers:
            return None  # only temporaries of a save that never completed
        raise ConfigError(f"{flag} {directory}: not a domino checkpoint directory (no 'latest' file; found "
                          f"{', '.join(sorted(leftovers)[:5])})")
    try:
        return weights_io.resolve_checkpoint_dir(path)
    except (ValueError, OSError) as error:
        pointed = path / (path / weights_io.LATEST_FILE).read_text(errors="replace").strip() \
            if (path / weights_io.LATEST_FILE).is_file() else None
        if pointed is not None and pointed.parent == path and pointed.is_dir():
            return pointed  # a torn checkpoint that `latest` names: choose_intact judges it and falls back
        raise ConfigError(f"{flag} {directory}: {error}") from error


def _older_checkpoints(ckpt: Path):
    """The checkpoints beside ``ckpt`` with a lower iteration, newest first."""
    tags = sorted((p.name for p in ckpt.parent.iterdir() if p.is_dir() and p.name.startswith("iter_")
                   and p.name < ckpt.name), reverse=True)
    return [ckpt.parent / tag for tag in tags]


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
    diffs = [f"{name}: checkpoint {getattr(saved, name)} vs run {getattr(config.model, name)}"
             for name in SHAPE_FIELDS if getattr(saved, name) != getattr(config.model, name)]
    if meta["padded_vocab_size"] != padded_vocab_size and not warm_start:
        diffs.append(f"padded vocabulary: checkpoint {meta['padded_vocab_size']} vs run {padded_vocab_size}")
    if diffs:
        raise ConfigError(f"--load {where}: the checkpoint's model has a different shape ({'; '.join(diffs)})")


#: Parameters with one row per vocabulary entry (the output layer exists only in a last pipeline stage).
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _model_weights(ckpt: Path, meta: Dict[str, Any], module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """This TP rank's weights from ``ckpt``, resharded and re-padded to ``module``'s vocabulary if needed."""
    from domino.model import sharding

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


def _files_to_read(ckpt: Path, config: DominoConfig, weights_only: bool) -> list:
    """The checkpoint files this rank reads when loading (names relative to ``ckpt``)."""
    meta = weights_io.read_checkpoint_meta(ckpt)
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


def _verified(ckpt: Path, config: DominoConfig, weights_only: bool) -> Path:
    """``ckpt`` once every rank has checked the checksums of the files it will read; else an intact older one.

    Each rank verifies only its own files, then all ranks exchange their findings, so they agree on one
    outcome: all load ``ckpt``, all fall back to the same older checkpoint, or all stop with the same message.
    """
    while True:
        problem = manifest.verify(ckpt, _files_to_read(ckpt, config, weights_only))
        findings = [problem]
        if dist.is_initialized() and dist.get_world_size() > 1:
            findings = [None] * dist.get_world_size()
            dist.all_gather_object(findings, problem)
        damaged = [f"rank {r}: {text}" for r, text in enumerate(findings) if text]
        if not damaged:
            return ckpt
        ckpt = _fall_back(ckpt, "; ".join(damaged), config.checkpoint.strict_load)


def load_checkpoint(engine, config: DominoConfig, ckpt: Path, padded_vocab_size: int,
                    weights_only: bool = False) -> Tuple[int, int]:
    """Checks that ``ckpt`` fits this run, then restores model, optimizer and RNG state into this rank.

    Args:
        padded_vocab_size: this run's padded vocabulary (see :func:`check_compatible`).
        weights_only: a warm start (``--finetune``): take the weights, keep the fresh optimizer and RNG.

    Returns:
        ``(iteration, consumed_samples)`` to continue from; ``(0, 0)`` for a warm start.
    """
    ckpt = _verified(ckpt, config, weights_only)
    meta = weights_io.read_checkpoint_meta(ckpt)
    check_compatible(meta, config, padded_vocab_size, ckpt, warm_start=weights_only)
    tp, dp = state.get_tensor_model_parallel_world_size(), state.get_data_parallel_world_size()
    engine.module.load_state_dict(_model_weights(ckpt, meta, engine.module), strict=True)
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()  # ZeRO keeps its own fp32 master copy of the weights
    c = config.checkpoint
    if weights_only:
        logger.info("warm start from %s (weights only, iteration 0)", ckpt)
        return 0, 0
    same_layout = meta["tensor_model_parallel_size"] == tp and meta.get("data_parallel_size") == dp
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not (ckpt / "optim").is_dir():
        logger.info("%s holds weights only (no optimizer or RNG state): continuing with a fresh optimizer", ckpt)
        return meta["iteration"], meta["consumed_samples"]
    if not c.no_load_optim:
        if not same_layout:
            raise ConfigError(
                f"--load {ckpt}: saved with TP={meta['tensor_model_parallel_size']} x DP={meta.get('data_parallel_size')}"
                f", this run is TP={tp} x DP={dp}; the optimizer state cannot be resharded. Use --finetune or "
                "--no-load-optim to take the weights only.")
        sd = torch.load(ckpt / "optim" / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=True)
        _restore_optimizer_state(engine, sd)
    if not c.no_load_rng and same_layout:
        _restore_rng_state(torch.load(ckpt / "rng" / f"rank_{rank:05d}.pt", weights_only=True))
    logger.info("resumed from %s at iteration %d (%d samples consumed)", ckpt, meta["iteration"],
                meta["consumed_samples"])
    return meta["iteration"], meta["consumed_samples"]
