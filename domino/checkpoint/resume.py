"""Resuming a training run from the checkpoint :mod:`domino.checkpoint.discovery` chose: checking it fits the
run, verifying it on every rank, loading it.

The counterpart of :mod:`domino.checkpoint.checkpointing` (same layout). A checkpoint whose files fail their
checksums falls back to the newest intact one (``--strict-load`` refuses), and every rank verifies and reads its
files before anything is applied, in agreements, so all ranks reach one outcome. Loading uses
``torch.load(weights_only=True)``, safetensors and DCP's safetensors reader: nothing arbitrary is unpickled.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional, Set, Tuple

import torch
import torch.distributed as dist

from domino.checkpoint import (distributed_io, fragment_io, manifest, model_shards, on_disk,
                               per_rank_state)
from domino.checkpoint.checkpointing import collective
from domino.checkpoint.discovery import fall_back
from domino.checkpoint.on_disk import Checkpoint
from domino.optim import state as optimizer_state, state_dict
from domino.config import ConfigError, DominoConfig
from domino.config.validate import resolve_zero_stage
from domino.config.batch_schedule import batch_schedule
from domino.pipeline.stages import stored_name
from domino.runtime.mesh import ParallelMesh, collective_device
from domino.runtime.agreement import AgreedFailure, agree

logger = logging.getLogger(__name__)

#: Model fields that must match between a checkpoint and the run loading it (the last ones decide which
#: parameters exist: learned position table, norm biases, linear biases, SwiGLU's gate, key/value heads, output).
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_size", "num_positions", "rope",
                "normalization", "disable_bias_linear", "swiglu", "query_groups", "untie_embeddings_and_output_weights")


def check_compatible(meta: Dict[str, Any], config: DominoConfig, where: Path) -> None:
    """Raises :class:`ConfigError` when the checkpoint's model cannot be loaded into this run's model.

    The vocabulary padding may differ (TP=2 pads GPT-2's vocabulary to 50432 rows, TP=1 to 50304): a resume
    keeps the checkpoint's where it can (:func:`keep_padded_vocab`), else padding rows are dropped or added.
    """
    from domino.config import config_from_dict

    saved = config_from_dict(meta["config"]).model
    # Rotary positions have no table: a rope model loads into a run with more (or fewer) positions, which is how
    # a context is extended.
    fields = [name for name in SHAPE_FIELDS if not (name == "num_positions" and saved.rope and config.model.rope)]
    diffs = [f"{name}: checkpoint {getattr(saved, name)} vs run {getattr(config.model, name)}"
             for name in fields if getattr(saved, name) != getattr(config.model, name)]
    if diffs:
        raise ConfigError(f"--load {where}: the checkpoint's model has a different shape ({'; '.join(diffs)})")


def keep_padded_vocab(ckpt: Optional[Checkpoint], config: DominoConfig, padded_vocab_size: int,
                      weights_only: bool) -> Tuple[DominoConfig, int, Optional[str]]:
    """The config and the padded vocabulary a resumed run builds its model with, and the one-line note saying so.

    The padding rows are part of the model being continued: they take part in the softmax (Megatron trains
    them: Megatron-LM d98e8a64 ``megatron/core/tokenizers/utils/build_tokenizer.py`` ``vocab_size_with_padding``
    pads to ``--make-vocab-size-divisible-by`` x TP, so GPT-2's 50,257 ids become 50,304 rows at TP 1 and 50,432 at
    TP 2). A resume therefore keeps the checkpoint's rows whenever this run's TP divides them, by setting
    ``--make-vocab-size-divisible-by`` to its rows over this TP (the run's flag shapes only a new model).
    Otherwise the table is re-padded to this run's own padding (:func:`_whole_model_weights`): the real rows,
    their weights and optimizer state unchanged, padding rows dropped or added as zeros (weights and moments; a
    zero row's logit is 0, as near as an untrained row's, the same on every rank and layout, and as
    ``domino import-hf`` pads). A warm start (``--finetune``) keeps the run's own padding.
    """
    if ckpt is None or weights_only or ckpt.meta["padded_vocab_size"] == padded_vocab_size:
        return config, padded_vocab_size, None
    saved, tp = ckpt.meta["padded_vocab_size"], config.parallel.tensor_model_parallel_size
    if saved % tp:
        return config, padded_vocab_size, (
            f"padded vocabulary: the checkpoint's {saved} rows cannot be split over TP={tp}: re-padded to this run's "
            f"{padded_vocab_size} (real rows and their optimizer state unchanged, padding rows zero)")
    # Any vocabulary up to ``saved`` pads to exactly ``saved`` rows with this multiple.
    divisor = saved // tp
    kept = config.replace(make_vocab_size_divisible_by=divisor)
    return kept, saved, (f"padded vocabulary: keeping the checkpoint's {saved} rows at TP={tp} "
                         f"(--make-vocab-size-divisible-by {divisor}; this run's padding alone gives {padded_vocab_size})")


#: Parameters with one row per vocabulary entry (the output layer exists only in a last pipeline stage).
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _model_weights(ckpt: Checkpoint, module: torch.nn.Module, rows: int, mesh: ParallelMesh
                   ) -> Dict[str, torch.Tensor]:
    """This TP rank's weights from ``ckpt``, resharded and re-padded to ``rows`` vocabulary rows if needed."""
    return _stage_weights(_whole_model_weights(ckpt, rows, mesh, stored_names(module, mesh)), module, mesh)


def stored_names(module: torch.nn.Module, mesh: ParallelMesh) -> Optional[Set[str]]:
    """The whole model's names of the tensors a pipeline stage's ``module`` holds (a last stage's tied copy goes
    by the embeddings'), so that it reads only those; None for the whole model (no stages)."""
    if mesh.pp.size == 1:
        return None
    params = dict(module.named_parameters())
    return {stored_name(name, params[name]) if name in params else name for name in module.state_dict()}


def _stage_weights(whole: Dict[str, torch.Tensor], module: torch.nn.Module, mesh: ParallelMesh
                   ) -> Dict[str, torch.Tensor]:
    """The entries of the whole model's ``whole`` that ``module`` (a pipeline stage, or the whole model) holds; a
    last stage's tied copy takes the embeddings'."""
    if mesh.pp.size == 1:
        return whole
    params = dict(module.named_parameters())
    return {name: whole[stored_name(name, params[name]) if name in params else name]
            for name in module.state_dict()}


def _whole_model_weights(ckpt: Checkpoint, rows: int, mesh: ParallelMesh, names: Optional[Set[str]] = None
                         ) -> Dict[str, torch.Tensor]:
    """This TP rank's slice of the whole model from ``ckpt`` (or of the tensors ``names``), re-padded to ``rows``
    vocabulary rows if needed."""
    from domino.checkpoint import sharding

    meta = ckpt.meta
    tp_rank, tp = mesh.tp.rank, mesh.tp.size
    if meta["padded_vocab_size"] == rows:
        return model_shards.load_model_shard(ckpt, tp_rank, tp, names)
    logger.info("re-padding the vocabulary from %d to %d rows", meta["padded_vocab_size"], rows)
    full = model_shards.load_full_state_dict(ckpt, names)
    for name in VOCAB_ROWS:
        if name in full:
            full[name] = repad(full[name], rows)
    return sharding.shard_state_dict(full, tp_rank, tp)


def repad(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor``'s first ``rows`` rows, with zero rows appended up to ``rows`` (see :func:`keep_padded_vocab`)."""
    kept = tensor[:rows]
    return torch.cat([kept, kept.new_zeros((rows - kept.shape[0], *kept.shape[1:]))])


def _same_layout(meta: Dict[str, Any], mesh: ParallelMesh) -> bool:
    return (meta["tensor_model_parallel_size"] == mesh.tp.size and meta.get("data_parallel_size") == mesh.dp.size
            and meta.get("pipeline_model_parallel_size", 1) == mesh.pp.size
            and meta.get("context_parallel_size", 1) == mesh.cp.size)


def _files_to_read(ckpt: Checkpoint, config: DominoConfig, weights_only: bool, mesh: ParallelMesh,
                   weights: Optional[Set[str]]) -> list:
    """The checkpoint files this rank verifies before loading (names relative to the checkpoint).

    The weight files are those holding the tensors ``weights`` (:func:`stored_names`) of this TP rank's (or, on
    another TP size, every TP rank's) slice. The optimizer state by name is read by whichever ranks need each
    slice, so its files are verified once, spread over the ranks (rank r takes every world-size-th file); the
    agreement after the check makes each verdict every rank's.
    """
    tp, tp_rank = mesh.tp.size, mesh.tp.rank
    meta, saved_tp = ckpt.meta, ckpt.tensor_model_parallel_size
    shards = model_shards.shard_paths(ckpt.path, meta)
    names = [f"{on_disk.MODEL_DIR}/{path.name}" for r in ([tp_rank] if saved_tp == tp else range(saved_tp))
             for path in model_shards.files_holding(shards[r], weights)]
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    c, kind = config.checkpoint, ckpt.optimizer_format
    if weights_only or kind is None:
        return names
    if not c.no_load_optim and kind == "by-name":
        stored = distributed_io.files(ckpt.path / on_disk.OPTIMIZER_DIR)
        names += [f"{on_disk.OPTIMIZER_DIR}/{p.name}" for p in stored[rank::world]]
    elif not c.no_load_optim:
        names.append(f"{on_disk.LEGACY_OPTIMIZER_DIR}/rank_{rank:05d}.pt")
    if not c.no_load_rng and _same_layout(meta, mesh):
        names.append(f"{on_disk.RNG_DIR}/rank_{rank:05d}.pt")
    return names


def _verified(ckpt: Checkpoint, config: DominoConfig, weights_only: bool, mesh: ParallelMesh,
              weights: Optional[Set[str]]) -> Checkpoint:
    """``ckpt`` once every rank has checked the checksums of the files it will read; else an intact older one.

    Each rank verifies only its own files, then all ranks agree, so they reach one outcome: all load
    ``ckpt``, all fall back to the same older checkpoint, or all stop with the same message.
    """
    while True:
        def check() -> None:
            problem = manifest.verify(ckpt.path, _files_to_read(ckpt, config, weights_only, mesh, weights))
            if problem:
                raise ConfigError(problem)

        try:
            agree(f"verifying checkpoint {ckpt.name}", check)
            return ckpt
        except AgreedFailure as failure:
            ckpt = fall_back(ckpt, str(failure), config.checkpoint.strict_load)


def resumed_zero_stage(ckpt: Optional[Checkpoint], config: DominoConfig, weights_only: bool,
                       data_parallel_size: int) -> Optional[int]:
    """The ZeRO stage a run without ``--zero-stage`` keeps from ``ckpt``; ``None`` for the default of its DP.

    On the checkpoint's own data-parallel size the run keeps its stage, so it continues bit for bit. On another
    DP it takes that DP's default (:func:`domino.config.validate.zero_stage_for`), which is what ``domino
    estimate`` and ``--parallel-layout derive`` assume for the new layout (a DP 1 ZeRO 0 checkpoint runs ZeRO 1
    at DP 2): any stage reads a state stored by name. A per-rank state of format 1 keeps its stage, as only a
    stage of its own kind reads it (:func:`_check_per_rank`).
    """
    if ckpt is None or weights_only or config.checkpoint.no_load_optim or ckpt.optimizer_format is None:
        return None
    parallel = ckpt.meta["config"].get("parallel")
    same_dp = ckpt.meta.get("data_parallel_size") == data_parallel_size
    if not isinstance(parallel, dict) or not (same_dp or ckpt.optimizer_format == "per-rank"):
        return None
    return parallel.get("zero_stage")


def choose_zero_stage(ckpt: Optional[Checkpoint], config: DominoConfig, weights_only: bool,
                      data_parallel_size: int) -> Tuple[DominoConfig, Optional[str]]:
    """``config`` with ``--zero-stage`` filled in when it was not given (:func:`resumed_zero_stage`), and the
    one-line note."""
    kept = resumed_zero_stage(ckpt, config, weights_only, data_parallel_size)
    config, note = resolve_zero_stage(config, data_parallel_size, kept)
    saved = (ckpt.meta["config"].get("parallel") or {}).get("zero_stage") if ckpt is not None else None
    if note and kept is None and saved is not None and saved != config.parallel.zero_stage:
        note += (f"; the checkpoint's ZeRO {saved} was for DP {ckpt.meta.get('data_parallel_size')}, this DP's "
                 "default is what `domino estimate` and --parallel-layout derive assume")
    return config, note


def fit_run_to(ckpt: Optional[Checkpoint], config: DominoConfig, padded_vocab_size: int, weights_only: bool,
               data_parallel_size: int) -> Tuple[DominoConfig, int]:
    """Settles what a resume takes from ``ckpt`` before the model is built: the padded vocabulary
    (:func:`keep_padded_vocab`) and the ZeRO stage at ``data_parallel_size`` (:func:`choose_zero_stage`), each
    said in one line; returns the config with both settled and the padded vocabulary."""
    config, padded, vocab_note = keep_padded_vocab(ckpt, config, padded_vocab_size, weights_only)
    config, zero_note = choose_zero_stage(ckpt, config, weights_only, data_parallel_size)
    for note in (n for n in (vocab_note, zero_note) if n and (not dist.is_initialized() or dist.get_rank() == 0)):
        logger.info("%s", note)
    return config, padded


def check_resumable(ckpt: Optional[Checkpoint], config: DominoConfig, data_parallel_size: int,
                    weights_only: bool) -> None:
    """Refuses, in one line and before anything is built, a checkpoint this run cannot continue exactly.

    The model's shape must match (:func:`check_compatible`). The data position (consumed
    samples) and the learning-rate schedule count whole global batches; another ``--global-batch-size`` would
    continue neither exactly. The micro-batch size and the layout may change: each global batch holds the same
    samples, split otherwise.
    """
    if ckpt is None:
        return
    meta = ckpt.meta
    check_compatible(meta, config, ckpt.path)
    if weights_only:
        return
    saved = meta.get("global_batch_size")
    if saved is None:  # format 1: derive it from the saved settings
        train = meta["config"].get("train", {})
        saved = train.get("global_batch_size") or train.get("micro_batch_size", 0) * meta.get("data_parallel_size", 1)
    run = batch_schedule(config, data_parallel_size).global_batch_size  # a ramp's final batch
    if saved and saved != run:
        raise ConfigError(f"--load {ckpt}: saved with a global batch of {saved} samples, this run's is {run} "
                          f"(--global-batch-size); its data position and schedule count batches of {saved}: "
                          f"resume with --global-batch-size {saved}, or warm-start with --finetune")


def _check_per_rank(ckpt: Checkpoint, config: DominoConfig, mesh: ParallelMesh) -> None:
    """Refuses to load format 1's per-rank optimizer state on another layout or another kind of optimizer."""
    meta = ckpt.meta
    tp, dp = mesh.tp.size, mesh.dp.size
    if not _same_layout(meta, mesh):
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
    if saved_stage == 0 and stage == 0 and meta["config"].get("train", {}).get("fp16"):
        # fp16 without ZeRO saved per rank only as DeepSpeed's FP16_Optimizer, before domino's own (mixed_precision).
        raise ConfigError(f"--load {ckpt}: its optimizer state is DeepSpeed's fp16 optimizer's at --zero-stage 0, "
                          "which domino's own --zero-stage 0 (fp32 masters) cannot take; use --no-load-optim to "
                          "take its fp16 weights only")


def _read_state(ckpt: Checkpoint, optimizer, config: DominoConfig, padded_vocab_size: int, weights_only: bool,
                mesh: ParallelMesh) -> Tuple[Dict[str, torch.Tensor], Optional[dict], Optional[dict]]:
    """This rank's model weights, per-rank optimizer state and RNG state from ``ckpt`` (nothing applied; the
    optimizer state by name is read afterwards, by all ranks together)."""
    meta, kind = ckpt.meta, ckpt.optimizer_format
    check_compatible(meta, config, ckpt.path)
    weights = _model_weights(ckpt, optimizer.module, padded_vocab_size, mesh)
    if weights_only or kind is None:
        return weights, None, None
    rank = dist.get_rank() if dist.is_initialized() else 0
    c, optim, rng = config.checkpoint, None, None
    if not c.no_load_optim and kind == "per-rank":
        _check_per_rank(ckpt, config, mesh)
        optim = torch.load(ckpt.path / on_disk.LEGACY_OPTIMIZER_DIR / f"rank_{rank:05d}.pt", map_location="cpu",
                           weights_only=True)
    elif not c.no_load_optim and not optimizer_state.supports(optimizer):
        raise ConfigError(f"--load {ckpt}: this run's optimizer keeps no state by name, so it cannot take the one "
                          "stored; resume with --zero-stage 1, or use --no-load-optim")
    elif not c.no_load_optim:
        optimizer_state.Scalars.from_json(meta["optimizer"], str(ckpt.path / on_disk.META_FILE))
        fragment_io.fragments_tp(meta, str(ckpt.path / on_disk.META_FILE))
    if not c.no_load_rng and _same_layout(meta, mesh):
        rng = torch.load(ckpt.path / on_disk.RNG_DIR / f"rank_{rank:05d}.pt", weights_only=True)
    return weights, optim, rng


#: Host memory for the optimizer state read at once (three fp32 tensors per parameter): 1 GiB.
READ_BATCH_BYTES = 1 << 30


def _repadded_vocab_state(ckpt: Checkpoint, optimizer, rows: int, mesh: ParallelMesh) -> Dict[str, torch.Tensor]:
    """This TP rank's optimizer state of the vocabulary parameters re-padded to ``rows`` rows (nothing when the
    run keeps the checkpoint's rows). Read whole in each process: a re-pad happens only at a TP that does not
    divide the checkpoint's rows (:func:`keep_padded_vocab`), and DCP reads only slices of a tensor's own shape."""
    from domino.checkpoint import sharding

    if ckpt.meta["padded_vocab_size"] == rows:
        return {}
    names = [f"{key}.{name}" for name, _ in optimizer_state.trainable(optimizer) if name in VOCAB_ROWS
             for key in optimizer_state.STATE_KEYS]
    whole = fragment_io.read_state(ckpt, names) if names else {}
    return sharding.shard_state_dict({name: repad(t, rows) for name, t in whole.items()}, mesh.tp.rank,
                                     mesh.tp.size)


def _load_optimizer_by_name(ckpt: Checkpoint, optimizer, rows: int, mesh: ParallelMesh) -> None:
    """Reads every rank's slices of the optimizer state stored by name and sets them, a batch of parameters at a
    time (each read is collective: DCP plans and reads together; the host holds one batch)."""
    optimizer_state.prepare(optimizer, optimizer_state.Scalars.from_json(ckpt.meta["optimizer"], str(ckpt)))
    directory = ckpt.path / on_disk.OPTIMIZER_DIR
    stored = distributed_io.stored_tensors(directory)  # every header read and checked once, before the first read
    repadded = _repadded_vocab_state(ckpt, optimizer, rows, mesh)
    optimizer_state.fill(optimizer, repadded)
    groups = [kept for kept in ([n for n in names if f"fp32.{n}" not in repadded]
                                for names in optimizer_state.batches(optimizer, READ_BATCH_BYTES)) if kept]
    if mesh.pp.size > 1:
        # Each read is collective over the world; stages hold different parameters: as many reads on every rank.
        count = torch.tensor([len(groups)], device=collective_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        groups += [[] for _ in range(int(count.item()) - len(groups))]
    saved_tp = fragment_io.fragments_tp(ckpt.meta, str(ckpt.path / on_disk.META_FILE))
    for names in groups:
        tensors = optimizer_state.empty_like_state(optimizer, names)
        if saved_tp is None:
            distributed_io.load(directory, tensors, mesh, stored)
        else:
            fragment_io.load(directory, tensors, mesh, saved_tp, stored)
        optimizer_state.fill(optimizer, tensors)


def load_checkpoint(optimizer, config: DominoConfig, mesh: ParallelMesh, ckpt: Checkpoint, padded_vocab_size: int,
                    weights_only: bool = False) -> Tuple[int, int]:
    """Checks that ``ckpt`` fits this run, then restores model, optimizer and RNG state into this rank.

    Every rank first verifies and reads what it needs; only when all ranks succeeded (an agreement) is
    anything applied, so a file that fails on one rank stops every rank with the same message. The optimizer
    state stored by name is then read by all ranks together and applied a batch of parameters at a time (host
    memory bounded by :data:`READ_BATCH_BYTES`); a failure there stops every rank too, before any step.

    Args:
        mesh: the run's parallel layout (which slices this rank reads).
        padded_vocab_size: this run's padded vocabulary (:func:`keep_padded_vocab`).
        weights_only: a warm start (``--finetune``): take the weights, keep the fresh optimizer and RNG.

    Returns:
        ``(iteration, consumed_samples)`` to continue from; ``(0, 0)`` for a warm start.
    """
    ckpt = _verified(ckpt, config, weights_only, mesh, stored_names(optimizer.module, mesh))
    meta, kind = ckpt.meta, ckpt.optimizer_format
    weights, optim, rng = agree(f"reading checkpoint {ckpt}", lambda: _read_state(
        ckpt, optimizer, config, padded_vocab_size, weights_only, mesh))
    optimizer.module.load_state_dict(weights, strict=True)
    optimizer.weights_loaded()  # ZeRO keeps its own fp32 master copy of the weights
    if weights_only:
        logger.info("warm start from %s (weights only, iteration 0)", ckpt)
        return 0, 0
    if kind is None:
        logger.info("%s holds weights only (no optimizer or RNG state): continuing with a fresh optimizer", ckpt)
        return meta["iteration"], meta["consumed_samples"]
    if kind == "by-name" and not config.checkpoint.no_load_optim:
        # After the weights: the master weights are the checkpoint's, not copies of the rounded model weights.
        collective(f"reading the optimizer state of {ckpt}",
                   lambda: _load_optimizer_by_name(ckpt, optimizer, padded_vocab_size, mesh))
    if optim is not None:
        state_dict.restore_optimizer(optimizer, optim, mesh.dp_cp)
    if rng is not None:
        per_rank_state.restore_rng(rng)
    logger.info("resumed from %s at iteration %d (%d samples consumed)", ckpt, meta["iteration"],
                meta["consumed_samples"])
    return meta["iteration"], meta["consumed_samples"]
