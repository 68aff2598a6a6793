"""Logic of the train-tokenizer step: a byte-level BPE fitted to the run's corpus, on the shared volume.

Plain Python, no kfp. A tokenizer trained on the corpus it will tokenize makes a small model learn far
faster than GPT-2's 50k-token vocabulary (most of whose rows such a model never sees): the local demo
trains a 2,048-token BPE on Shakespeare in about a second. With ``vocab_size`` 0 the step trains nothing
and passes the named tokenizer on, so the preprocess and pretrain steps always read the tokenizer from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from components.declare import config_field, config_values
from components.layout import RunLayout
from components.preprocess.step import parse_keys, resolve_inputs
from components.run_settings import CorpusSettings, RunSettings
from domino.config.schema import DataConfig


def tokenizer_dir(shared_root: str, run_id: str) -> str:
    """Where the run's trained tokenizer is saved: ``<run>/data/tokenizer`` on the shared volume."""
    return os.path.join(RunLayout(shared_root, run_id).data_dir, "tokenizer")


@dataclass(kw_only=True)
class TokenizerSettings(CorpusSettings, RunSettings):
    """Parameters of the train-tokenizer step (one field per component parameter)."""

    # Passed on as it is when tokenizer_vocab_size is 0.
    tokenizer: str = config_field("gpt2")
    tokenizer_vocab_size: int = 0
    """Train a byte-level BPE of this many tokens on the corpus (0: use tokenizer)."""


def run_train_tokenizer(settings: TokenizerSettings, log: Callable[[str], None] = print) -> str:
    """Trains a byte-level BPE of ``tokenizer_vocab_size`` tokens on the input, or passes ``tokenizer`` on.

    Args:
        settings: The step's parameters.
        log: Receives one line about what was done.

    Returns:
        The tokenizer spec for the later steps: the trained tokenizer's folder, or ``tokenizer``.

    Raises:
        ValueError: a bad vocabulary size or input, before anything is written.
    """
    from domino.data.errors import DataError
    from domino.data.tokenizer_training import MIN_VOCAB_SIZE, train_tokenizer

    vocab_size, input_uri, corpus = settings.tokenizer_vocab_size, settings.input_uri, settings.corpus
    if vocab_size == 0:
        tokenizer = config_values(settings).get("tokenizer", DataConfig().tokenizer)  # not given: domino's default
        log(f"train-tokenizer: tokenizer_vocab_size is 0, using {tokenizer}")
        return tokenizer
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"tokenizer_vocab_size: {vocab_size} is below {MIN_VOCAB_SIZE} (256 bytes + "
                         "end-of-document); use 0 to keep the named tokenizer")
    inputs = resolve_inputs(input_uri) if input_uri.strip() else None
    if inputs is None and not corpus:
        raise ValueError("train-tokenizer: give input_uri or a built-in corpus name")
    keys = parse_keys(settings.json_keys)
    output = tokenizer_dir(settings.shared_root, settings.run_id)
    try:
        trained = train_tokenizer(inputs, vocab_size, output, json_keys=keys,
                                  builtin_corpus=None if inputs else corpus)
    except DataError as error:
        raise ValueError(f"train-tokenizer: {error}") from None
    log(f"train-tokenizer: byte-level BPE of {trained.vocab_size} tokens -> {output}")
    return output
