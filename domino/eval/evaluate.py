"""Evaluating a checkpoint on a dataset: loss, perplexity, token accuracy, tokens evaluated.

The data path is the training one (GPTDataset samples, the Megatron sampler, ``get_batch`` with its
loss mask and end-of-document options), so a number here means the same as a validation loss logged
during training. Only TP rank 0 of each group reads data; ``get_batch`` broadcasts the batch to the
other TP ranks. With data-parallel replicas each evaluates different batches and the sums are reduced.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple, Union

import torch

from domino.config import ConfigError, DominoConfig, config_from_dict
from domino.data.batch import get_batch
from domino.data.dataset_builder import build_train_valid_test_datasets, parse_data_prefix
from domino.data.loader import build_pretraining_data_loader
from domino.eval.metrics import evaluate_batches
from domino.eval.runtime import default_device, setup_tensor_parallel
from domino.eval.settings import EvalSettings

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]

if TYPE_CHECKING:  # the checkpoint package is imported where a checkpoint is read
    from domino.checkpoint.on_disk import Checkpoint


def _is_blend(selection: Dict[str, Any]) -> bool:
    spec = selection.get("data_prefix") or selection.get("test_data_prefix")
    return len(parse_data_prefix(spec)[0]) > 1


def _data_selection(config: DominoConfig, data_prefix: Union[str, Sequence[str], None],
                    split: Optional[str]) -> Tuple[Dict[str, Any], str]:
    """Builder arguments selecting the documents to evaluate, and a description for messages."""
    if data_prefix:
        prefixes = [data_prefix] if isinstance(data_prefix, (str, Path)) else [str(p) for p in data_prefix]
        if split:
            return {"data_prefix": prefixes, "splits_string": split}, f"test split {split} of {' '.join(prefixes)}"
        return {"data_prefix": prefixes, "splits_string": "0,0,1"}, f"all documents of {' '.join(prefixes)}"
    d = config.data
    if d.test_data_path:
        return {"data_prefix": None, "splits_string": d.split, "test_data_prefix": list(d.test_data_path)}, \
            f"--test-data-path {' '.join(d.test_data_path)}"
    if d.data_path:
        chosen = split or d.split
        return {"data_prefix": list(d.data_path), "splits_string": chosen}, \
            f"test split {chosen} of {' '.join(d.data_path)}"
    raise ConfigError("the checkpoint records no --data-path or --test-data-path: pass --data-path")


def _plan_batches(dataset_len: int, per_step: int, eval_iters: Optional[int], max_samples: Optional[int],
                  what: str) -> int:
    """Number of micro-batch steps (each ``per_step`` = micro-batch x DP samples) to evaluate."""
    available = dataset_len // per_step
    if available == 0:
        raise ConfigError(f"{what} holds {dataset_len} samples, fewer than one micro-batch x data-parallel size "
                          f"({per_step}); use a smaller --micro-batch-size or --seq-length")
    if eval_iters is not None:
        wanted = eval_iters
    elif max_samples is not None:
        wanted = math.ceil(max_samples / per_step)
    else:
        return available
    if wanted > available:
        logger.warning("%s holds only %d batches; evaluating those instead of %d", what, available, wanted)
    return min(wanted, available)


def _open_test_data(selection: Dict[str, Any], what: str, seq: int, seed: int, data_cache_path: Optional[str],
                    per_step: int, eval_iters: Optional[int], max_samples: Optional[int], vocab_size: int):
    """The test dataset and the number of micro-batch steps to take (collective: every rank calls it).

    ``per_step``: the samples of one step over every data-parallel replica; ``vocab_size``: the checkpoint
    tokenizer's; a dataset holding a larger token id is refused when it is opened
    (it was tokenised with another tokenizer, and would index past the embedding)."""
    # One pass over a single dataset: ask for one sample, get one whole epoch. An explicit amount larger
    # than an epoch repeats documents, as training does. A blend is exactly as long as asked for, so it
    # needs an explicit amount.
    wanted = max_samples or (eval_iters * per_step if eval_iters else 1)
    selection = dict(selection)
    _, _, test = build_train_valid_test_datasets(
        splits_string=selection.pop("splits_string"), train_valid_test_num_samples=[0, 0, wanted],
        seq_length=seq, seed=seed, skip_warmup=True, data_cache_path=data_cache_path, vocab_size=vocab_size,
        **selection)
    if test is None or len(test) == 0:
        raise ConfigError(f"{what} selects no documents to evaluate")
    return test, _plan_batches(len(test), per_step, eval_iters, max_samples, what)


def evaluate_checkpoint(
    load: Union[PathLike, "Checkpoint"],
    data_prefix: Union[str, Sequence[str], None] = None,
    settings: Optional[EvalSettings] = None,
    *,
    split: Optional[str] = None,
    seq_length: Optional[int] = None,
    eod_mask_loss: Optional[bool] = None,
    reset_position_ids: Optional[bool] = None,
    reset_attention_mask: Optional[bool] = None,
    tensor_model_parallel_size: Optional[int] = None,
    tokenizer_spec: Optional[str] = None,
    seed: Optional[int] = None,
    data_cache_path: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device, None] = None,
    progress: bool = False,
) -> Dict[str, Any]:
    """Evaluates a checkpoint; works on one process and TP-parallel under torchrun.

    Args:
        load: a save root (its ``latest``), an ``iter_*`` checkpoint directory (saved with any TP size), or a
            ``domino.checkpoint.on_disk.Checkpoint`` already opened (its metadata is not read again).
        data_prefix: dataset prefix(es) (optionally weighted: ``["0.3", "a", "0.7", "b"]``). ``None``:
            the test split of the data the checkpoint was trained on.
        split: with ``data_prefix``, evaluate only the test part of this ``train,valid,test`` split
            (default: every document of ``data_prefix``). Without it, overrides the checkpoint's split.
        settings: how much to evaluate and the micro-batch size (default: :class:`EvalSettings`' defaults, the
            same as ``domino evaluate``'s).
        seq_length: sample length (default: the checkpoint's ``--seq-length``).
        eod_mask_loss / reset_position_ids / reset_attention_mask: override the checkpoint's setting.
        tensor_model_parallel_size: TP size (default: the number of processes).
        tokenizer_spec: override the checkpoint's tokenizer (its end-of-document id matters).
        seed: sample-order seed (default: the checkpoint's ``--seed``).
        data_cache_path: where sample indices are cached (default: beside the data).
        dtype: model dtype.
        device: where the model runs (default: this process's GPU, else CPU).
        progress: show a progress bar on rank 0.

    Returns:
        ``{"loss", "ppl", "accuracy", "tokens", "samples", "batches", "checkpoint", "iteration", "data"}``.

    Raises:
        ConfigError: for a bad checkpoint or data path, an empty selection, or impossible settings.
    """
    from domino.checkpoint.model_loading import build_model_from_checkpoint
    from domino.checkpoint.on_disk import Checkpoint

    settings = settings or EvalSettings()
    settings.check()
    micro_batch_size, eval_iters, max_samples = settings.micro_batch_size, settings.eval_iters, settings.max_samples
    max_tokens = settings.token_budget
    ckpt = Checkpoint.open(load)  # checkpoint.json read and checked once, then passed along
    ckpt_dir = ckpt.path
    config = config_from_dict(ckpt.meta["config"])
    seq = seq_length or config.model.seq_length
    if not 1 <= seq <= config.model.num_positions:
        raise ConfigError(f"--seq-length {seq} must be in [1, {config.model.num_positions}] "
                          "(the checkpoint's position embeddings)")
    data_config = dataclasses.replace(config.data, **{
        name: value for name, value in (("eod_mask_loss", eod_mask_loss), ("reset_position_ids", reset_position_ids),
                                        ("reset_attention_mask", reset_attention_mask)) if value is not None})
    selection, what = _data_selection(config, data_prefix, split)
    if max_tokens is not None and _is_blend(selection):
        # A blend is exactly as long as asked for: the budget is its length.
        max_samples, max_tokens = math.ceil(max_tokens / seq), None
    if eval_iters is None and max_samples is None and _is_blend(selection):
        raise ConfigError(f"{what} is a blend of datasets: give --eval-tokens N, --eval-iters or "
                          "--max-samples (a blend has no natural single pass)")

    mesh = setup_tensor_parallel(tensor_model_parallel_size)
    model, meta, tokenizer = build_model_from_checkpoint(
        ckpt, mesh.tp, device=device or default_device(), dtype=dtype, tokenizer_spec=tokenizer_spec)
    per_step = micro_batch_size * mesh.dp.size

    # Every rank builds the dataset (the index cache is built by global rank 0 in an agreement that all
    # ranks join) and so knows the number of steps; only TP rank 0 reads batches, get_batch broadcasts them.
    test, steps = _open_test_data(selection, what, seq, config.train.seed if seed is None else seed,
                                  data_cache_path, per_step, eval_iters, max_samples, tokenizer.vocab_size)
    if max_tokens is not None:
        # A budget caps one pass over the selection; unlike --max-samples it never repeats documents.
        steps = min(steps, math.ceil(max_tokens / (seq * per_step)))
    logger.info("evaluating %d samples (%d tokens) of %s at micro-batch %d", steps * per_step, steps * per_step * seq,
                what, micro_batch_size)
    iterator = None
    if mesh.tp.rank == 0:
        iterator = iter(build_pretraining_data_loader(test, 0, micro_batch_size, mesh.dp.rank, mesh.dp.size, 0))
    model_device = next(model.parameters()).device

    def batches():
        for _ in range(steps):
            tokens, labels, loss_mask, attention_mask, position_ids = get_batch(iterator, data_config, tokenizer.eod,
                                                                                tp=mesh.tp)
            yield tuple(t.to(model_device) if t is not None else None
                        for t in (tokens, labels, loss_mask, attention_mask, position_ids))

    result = evaluate_batches(model, batches(), total=steps, progress=progress, dp=mesh.dp)
    result.update(samples=steps * per_step, batches=steps, checkpoint=str(ckpt_dir), iteration=meta["iteration"],
                  data=what)
    logger.info("evaluated %s on %s: loss %.4f, ppl %.3f, accuracy %.4f over %d tokens", ckpt_dir, what,
                result["loss"], result["ppl"], result["accuracy"], result["tokens"])
    return result
