"""Tiny models, tokenizers, datasets and checkpoints for the evaluation tests (no training needed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from domino.config import DominoConfig, ModelConfig, config_to_dict, padded_vocab_size
from domino.data.tokenizer import Tokenizer
from domino.model import GPTModel
from domino.checkpoint import on_disk as wio
from domino.checkpoint import model_shards

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end them. ") * 4


def tiny_tokenizer(directory: Path) -> Tokenizer:
    """A byte-level BPE with ~300 ids and ``<|endoftext|>``, trained in a few milliseconds, saved in ``directory``."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([TEXT], trainer=trainer)
    tokenizer = Tokenizer(backend, name=str(directory))
    tokenizer.save(str(directory))
    return tokenizer


def tiny_config(tokenizer_spec: str = "gpt2", **model) -> DominoConfig:
    """Two layers, hidden 32, 4 heads, 32 positions, no dropout, vocab padded to a multiple of 8 x TP."""
    shape = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                 hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
    return DominoConfig(model=ModelConfig(**{**shape, **model})).replace(tokenizer=tokenizer_spec)


def tiny_model(config: DominoConfig, vocab_size: int, seed: int = 0, std: float = 0.3) -> GPTModel:
    """A TP=1 model with large random weights (so greedy choices are well separated), in eval mode."""
    torch.manual_seed(seed)
    padded = padded_vocab_size(vocab_size, config)
    model = GPTModel(config.model, padded)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, std)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.05)
    return model.eval()


def save_checkpoint(root: Path, model: GPTModel, config: DominoConfig, tp: int = 1, iteration: int = 1,
                    tokenizer: Optional[Tokenizer] = None) -> Path:
    """Saves ``model`` (TP=1 in memory) as a checkpoint sharded ``tp`` ways, the way training would."""
    from domino.checkpoint.sharding import shard_state_dict

    ckpt = root / wio.checkpoint_tag(iteration)
    full = model.state_dict()
    for rank in range(tp):
        model_shards.save_model_shard(ckpt, full if tp == 1 else shard_state_dict(full, rank, tp), rank)
    if tokenizer is not None:
        tokenizer.save(str(ckpt / wio.TOKENIZER_DIR))
    saved = config.replace(tensor_model_parallel_size=tp)
    wio.write_checkpoint_meta(ckpt, {
        "iteration": iteration, "consumed_samples": 0, "tensor_model_parallel_size": tp,
        "padded_vocab_size": model.vocab_size, "tokenizer": config.data.tokenizer, "config": config_to_dict(saved)})
    wio.write_latest(root, wio.checkpoint_tag(iteration))
    return ckpt


def tiny_checkpoint(root: Path, name: str = "ckpt", seed: int = 3, **model) -> Tokenizer:
    """A tiny model of :func:`tiny_config` (``model`` overrides) with :func:`tiny_tokenizer`'s ``root/tok``, saved
    as the checkpoint ``root/name``; returns the tokenizer."""
    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer(root / "tok")
    config = tiny_config(str(root / "tok"), **model)
    save_checkpoint(root / name, tiny_model(config, tokenizer.vocab_size, seed=seed), config, tokenizer=tokenizer)
    return tokenizer


def write_token_dataset(prefix: Path, vocab_size: int, documents: int = 12, seed: int = 0, eod: int = 0) -> str:
    """A ``.bin``/``.idx`` pair of random documents, each ending with ``eod``; returns the prefix."""
    from domino.data.indexed_dataset import IndexedDatasetWriter, token_dtype

    rng = np.random.default_rng(seed)
    os.makedirs(prefix.parent, exist_ok=True)
    with IndexedDatasetWriter(str(prefix), token_dtype(vocab_size)) as writer:
        for _ in range(documents):
            length = int(rng.integers(8, 40))
            tokens = np.append(rng.integers(1, vocab_size, size=length), eod)
            writer.add_document(tokens.astype(token_dtype(vocab_size)))
    return str(prefix)


def run_cli(argv, capsys):
    """Runs ``domino ARGV`` in-process; returns ``(exit code, stdout, stderr)``."""
    import pytest

    from domino.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err
