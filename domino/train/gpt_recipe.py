"""The GPT builders ``pretrain`` runs by default: model, datasets and the forward step with its loss.

Users with their own model or data swap in their own three callables; these are the reference ones and
follow Megatron-LM's ``pretrain_gpt.py`` contracts.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from domino.config import ConfigError, DominoConfig, padded_vocab_size
from domino.data.batch import get_batch
from domino.data.dataset_builder import build_train_valid_test_datasets, parse_data_prefix
from domino.data.mock import MockGPTDataset
from domino.data.tokenizer import tokenizer_for_run
from domino.model import GPTModel
from domino.parallel import kernels
from domino.parallel.context_split import masked_mean_loss, split_batch, sum_over_context
from domino.runtime.mesh import SINGLE, MeshGroup, ParallelMesh, collective_device
from domino.train.parallelize import parallelize

logger = logging.getLogger(__name__)


def average_across_data_parallel_group(value: torch.Tensor, dp: MeshGroup) -> torch.Tensor:
    """Mean of a scalar over the replicas of ``dp`` (a detached copy, for logging)."""
    averaged = value.detach().clone().float().reshape(1)
    if dp.size > 1:
        dist.all_reduce(averaged, group=dp.process_group)
        averaged /= dp.size
    return averaged[0]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, dp: MeshGroup = SINGLE, cp: MeshGroup = SINGLE
              ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Masked mean of the per-token losses; also returns it averaged over the data-parallel group for logging.

    Under context parallelism each rank holds part of every sequence: its masked sum is divided by the count of
    the whole sequences, so the loss returned is this rank's share of the mean (the shares of ``cp`` add up to it,
    and so do their gradients: :mod:`domino.parallel.context_split`); the logged value is the whole mean.

    Args:
        loss_mask: ``[b, s]`` with 1 where a token counts.
        output_tensor: per-token losses ``[b, s]`` from the model.
        dp: the data-parallel group of the logged average (one process by default).
        cp: the context-parallel group that holds the rest of these sequences (one process by default).
    """
    loss = masked_mean_loss(output_tensor, loss_mask, cp)
    return loss, {"lm loss": average_across_data_parallel_group(sum_over_context(loss, cp), dp)}


def check_data_prefixes(config: DominoConfig) -> None:
    """Fails before any work when a ``--*data-path`` prefix lacks its ``.bin`` or ``.idx`` file."""
    d = config.data
    for flag, values in (("--data-path", d.data_path), ("--train-data-path", d.train_data_path),
                         ("--valid-data-path", d.valid_data_path), ("--test-data-path", d.test_data_path)):
        for prefix in (parse_data_prefix(values)[0] if values else []):
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ConfigError(f"{flag}: dataset prefix '{prefix}' has no {' or '.join(missing)} "
                                  "(create it with `domino preprocess`)")


class GPTRecipe:
    """Tokenizer-aware builders for a GPT run of ``config`` on ``mesh``.

    Attributes:
        mesh: the run's layout: the model is split over it and the batches are broadcast over its TP group.
        tokenizer: the run's tokenizer (``None`` with ``--mock-data`` and an explicit ``--vocab-size``).
        vocab_size: the vocabulary the datasets' token ids are checked against.
        padded_vocab_size: the vocabulary padded as Megatron's ``--make-vocab-size-divisible-by`` does.
        eod: the end-of-document token id.
        kernel_choice: the ops' kernel choice (``DOMINO_KERNELS`` as the entry point read it:
            :func:`domino.parallel.kernels.from_environment`); None: each device's own.
    """

    def __init__(self, config: DominoConfig, mesh: ParallelMesh, kernel_choice: kernels.Choice = None) -> None:
        self.config, self.mesh, self.kernel_choice = config, mesh, kernel_choice
        check_data_prefixes(config)
        self.tokenizer = None
        null = config.data.tokenizer_type == "NullTokenizer"
        if not (config.data.mock_data and config.model.vocab_size) and not null:
            self.tokenizer = tokenizer_for_run(config.data)
        # Megatron's NullTokenizer: ids below --vocab-size, end-of-document id --vocab-size, one more in the vocabulary.
        vocab = config.model.vocab_size + 1 if null else config.model.vocab_size or self.tokenizer.vocab_size
        if self.tokenizer is not None and self.tokenizer.vocab_size > vocab:  # its ids would index past the table
            name = config.data.tokenizer_model or config.data.tokenizer
            raise ConfigError(f"--vocab-size {vocab} is smaller than tokenizer {name}'s {self.tokenizer.vocab_size} "
                              "ids (a LLaMA preset's "
                              "--vocab-size is its own tokenizer's: give that with --tokenizer-type "
                              "HuggingFaceTokenizer --tokenizer-model, or drop --vocab-size)")
        self.vocab_size = vocab  # the datasets' token ids must lie below it
        self.padded_vocab_size = padded_vocab_size(vocab, config)
        self.eod = self.tokenizer.eod if self.tokenizer is not None else vocab - 1

    def model_builder(self, config: DominoConfig, mesh: ParallelMesh) -> torch.nn.Module:
        """A ``GPTModel`` of ``config``'s shape split over ``mesh.tp``, made this rank's part of the run by
        :func:`domino.train.parallelize.parallelize` (its pipeline stage or interleaved chunks, with the sequence
        parallelism, Domino chunks and activation recompute of ``config``). ``mesh`` is ``pretrain``'s, which is
        the recipe's: the batches it reads are broadcast over the TP group the model is split over."""
        if mesh != self.mesh:
            raise ValueError("GPTRecipe.model_builder: the mesh differs from the recipe's (the batches would be "
                             "broadcast over another TP group than the model's)")
        # From ``config``: a resume may keep its checkpoint's padding (domino.checkpoint.resume.keep_padded_vocab).
        model = GPTModel(config.model, padded_vocab_size(self.vocab_size, config), tp=mesh.tp, cp=mesh.cp)
        # The device the optimizer's builder moves the model to (it is built on the host).
        table = kernels.for_device(self.kernel_choice, collective_device(mesh.tp.process_group))
        return parallelize(model, mesh, config, table)

    def dataset_builder(self, num_samples: Tuple[int, int, int]) -> Tuple[Any, Optional[Any], Optional[Any]]:
        """Train/valid/test datasets holding at least ``num_samples`` samples each."""
        d, seq = self.config.data, self.config.model.seq_length
        if d.mock_data:
            return tuple(  # type: ignore[return-value]
                # Ids of the vocabulary itself, as a tokenizer would give (never the padding rows, whose count a
                # resume may take from its checkpoint: domino.checkpoint.resume.keep_padded_vocab).
                MockGPTDataset(n, seq, self.vocab_size if self.tokenizer is None else self.tokenizer.vocab_size,
                               self.config.train.seed + i) if n else None
                for i, n in enumerate(num_samples))
        return build_train_valid_test_datasets(
            data_prefix=d.data_path or None, splits_string=d.split, train_valid_test_num_samples=list(num_samples),
            seq_length=seq, seed=self.config.train.seed, skip_warmup=not d.mmap_warmup,
            train_data_prefix=d.train_data_path or None, valid_data_prefix=d.valid_data_path or None,
            test_data_prefix=d.test_data_path or None, data_cache_path=d.data_cache_path, vocab_size=self.vocab_size)

    def batch(self, data_iterator) -> Dict[str, torch.Tensor]:
        """One micro-batch's tensors by name (what a pipeline stage reads: :mod:`domino.train.pipeline_step`): this
        rank's chunks of them under context parallelism (:func:`~domino.parallel.context_split.split_batch`)."""
        shape = (self.config.train.micro_batch_size, self.config.model.seq_length + 1)  # fixed: no shape broadcast
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, self.config.data, self.eod,
                                                                            shape, self.mesh.tp)
        return split_batch(dict(tokens=tokens, labels=labels, loss_mask=loss_mask, attention_mask=attention_mask,
                                position_ids=position_ids), self.mesh.cp)

    def forward_step(self, data_iterator, model):
        """One micro-batch forward: ``(per-token losses, partial(loss_func, loss_mask))``."""
        b = self.batch(data_iterator)
        output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return output, partial(loss_func, b["loss_mask"], dp=self.mesh.dp, cp=self.mesh.cp)
