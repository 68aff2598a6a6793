"""Logic of the train-tokenizer step: a byte-level BPE fitted to the run's corpus, on the shared volume.

Plain Python, no kfp. A tokenizer trained on the corpus it will tokenize makes a small model learn far
faster than GPT-2's 50k-token vocabulary (most of whose rows such a model never sees): the local demo
trains a 2,048-token BPE on Shakespeare in about a second. With ``vocab_size`` 0 the step trains nothing
and passes the named tokenizer on, so the preprocess and pretrain steps always read the tokenizer from it.
"""

from __future__ import annotations

import os
from typing import Callable

from components.layout import RunLayout
from components.preprocess.step import resolve_inputs


def tokenizer_dir(shared_root: str, run_id: str) -> str:
    """Where the run's trained tokenizer is saved: ``<run>/data/tokenizer`` on the shared volume."""
    return os.path.join(RunLayout(shared_root, run_id).data_dir, "tokenizer")


def run_train_tokenizer(
    shared_root: str,
    run_id: str,
    corpus: str = "shakespeare",
    input_uri: str = "",
    tokenizer: str = "gpt2",
    vocab_size: int = 0,
    json_keys: str = "text",
    log: Callable[[str], None] = print,
) -> str:
    """Trains a byte-level BPE of ``vocab_size`` tokens on the input, or passes ``tokenizer`` on.

    Args:
        shared_root: Shared volume root (see :class:`components.layout.RunLayout`).
        run_id: Pipeline run id.
        corpus: Built-in corpus name, used when ``input_uri`` is empty.
        input_uri: Comma-separated paths or ``file://`` URIs of JSON-lines or text files.
        tokenizer: The tokenizer to use when ``vocab_size`` is 0 (returned unchanged).
        vocab_size: Tokens of the BPE to train (0: train none).
        json_keys: Comma-separated JSON keys whose texts the BPE is trained on.
        log: Receives one line about what was done.

    Returns:
        The tokenizer spec for the later steps: the trained tokenizer's folder, or ``tokenizer``.

    Raises:
        ValueError: a bad vocabulary size or input, before anything is written.
    """
    from domino.data.errors import DataError
    from domino.data.tokenizer_training import MIN_VOCAB_SIZE, train_tokenizer

    if vocab_size == 0:
        if not tokenizer:
            raise ValueError("tokenizer: empty; name a tokenizer (gpt2) or set tokenizer_vocab_size > 0")
        log(f"train-tokenizer: tokenizer_vocab_size is 0, using {tokenizer}")
        return tokenizer
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"tokenizer_vocab_size: {vocab_size} is below {MIN_VOCAB_SIZE} (256 bytes + "
                         "end-of-document); use 0 to keep the named tokenizer")
    inputs = resolve_inputs(input_uri) if input_uri.strip() else None
    if inputs is None and not corpus:
        raise ValueError("train-tokenizer: give input_uri or a built-in corpus name")
    keys = tuple(key.strip() for key in json_keys.split(",") if key.strip())
    output = tokenizer_dir(shared_root, run_id)
    try:
        trained = train_tokenizer(inputs, vocab_size, output, json_keys=keys,
                                  builtin_corpus=None if inputs else corpus)
    except DataError as error:
        raise ValueError(f"train-tokenizer: {error}") from None
    log(f"train-tokenizer: byte-level BPE of {trained.vocab_size} tokens -> {output}")
    return output
