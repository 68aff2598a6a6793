"""``domino train-tokenizer``: a byte-level BPE (GPT-2 style) trained on your text with Hugging Face ``tokenizers``.

The result has the end-of-document special token ``<|endoftext|>`` (id 0, unless the caller picks other
special tokens), GPT-2's pre-tokenisation and byte-level decoding, and is saved with
:meth:`Tokenizer.save` so ``--tokenizer DIR`` (and ``GPT2TokenizerFast.from_pretrained(DIR)``) loads it.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Optional, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from domino.atomic_files import name_too_long
from domino.data.builtin_corpora import builtin_documents
from domino.data.errors import DataError
from domino.data.input_files import expand_inputs
from domino.data.text_inputs import BadLineCounter, read_documents
from domino.data.tokenizer import GPT2_EOD_TOKEN, Tokenizer

logger = logging.getLogger(__name__)

#: The smallest useful vocabulary: 256 byte symbols plus the special tokens.
MIN_VOCAB_SIZE = 257


def train_byte_level_bpe(texts: Iterator[str], vocab_size: int, eod_token: str = GPT2_EOD_TOKEN,
                         min_frequency: int = 2) -> Tokenizer:
    """Trains a byte-level BPE with ``eod_token`` as its special end-of-document token.

    Args:
        texts: training documents.
        vocab_size: total vocabulary size, special token included (at least 257).
        eod_token: the end-of-document token (kept whole, never merged).
        min_frequency: a pair must occur this often to become a merge.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + end-of-document), got {vocab_size}")
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eod_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend, name="trained-byte-level-bpe", eod=backend.token_to_id(eod_token))


def train_tokenizer(inputs: Optional[Sequence[str]], vocab_size: int, output: str,
                    json_keys: Sequence[str] = ("text",), builtin_corpus: Optional[str] = None,
                    min_frequency: int = 2, txt_document_per_file: bool = False,
                    skip_bad_lines: bool = False) -> Tokenizer:
    """Trains on ``inputs`` (same formats as ``preprocess``) or a built-in corpus and saves to ``output``.

    Every ``json_keys`` text of every document is a training text. Returns the trained tokenizer, whose
    ``name`` is then ``output``.

    Raises:
        DataError: for bad arguments or bad input, before anything is written to ``output``.
    """
    if bool(inputs) == bool(builtin_corpus):
        raise DataError("give either --input files or --builtin-corpus (exactly one of them)")
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"--vocab-size must be >= {MIN_VOCAB_SIZE} (256 bytes + end-of-document), got {vocab_size}")
    problem = name_too_long(output)  # the folder is made only after training
    if problem:
        raise DataError(f"--output {output}: {problem}")
    bad = BadLineCounter()
    if builtin_corpus:
        documents = builtin_documents(builtin_corpus)
    else:
        documents = read_documents(expand_inputs(inputs), tuple(json_keys), txt_document_per_file,
                                   skip_bad_lines, bad)
    count = 0

    def texts() -> Iterator[str]:
        nonlocal count
        for document in documents:
            count += 1
            for text in document.texts:
                yield from ([text] if isinstance(text, str) else text)

    start = time.perf_counter()
    tokenizer = train_byte_level_bpe(texts(), vocab_size, min_frequency=min_frequency)
    if count == 0:
        raise DataError("the input holds no documents to train on")
    bad.log_summary()
    if tokenizer.vocab_size < vocab_size:
        logger.warning("the input supports only %d tokens (asked for %d): too little text, or --min-frequency %d "
                       "too high", tokenizer.vocab_size, vocab_size, min_frequency)
    tokenizer.save(output)
    tokenizer.name = output
    logger.info("trained a byte-level BPE of %d tokens on %d documents in %.1f s -> %s (eod id %d)",
                tokenizer.vocab_size, count, time.perf_counter() - start, output, tokenizer.eod)
    return tokenizer
