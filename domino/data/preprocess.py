"""``domino preprocess``: text files (or a built-in corpus) -> Megatron ``.bin``/``.idx`` datasets.

For every ``--json-keys`` key the output is ``{output_prefix}_{key}_document.bin/.idx``, exactly as
Megatron-LM's ``tools/preprocess_data.py`` writes it (one sequence per document, uint16 tokens when the
highest token id + 1 is below 65500, else int32; with ``append_eod`` the end-of-document id closes
every document). A JSON value that is a list of strings gives one sequence per non-empty string, as
Megatron's sentence lists do; a document without tokens is an empty entry of the document index.

Tokenisation runs in the Rust ``tokenizers`` library on batches of documents; ``workers`` threads each
encode whole batches (the library releases the GIL), so the work spreads over ``workers`` cores.
Output goes to temporary files that are fsynced and renamed only when everything succeeded: an
interrupted or failed run leaves no dataset under the final names. Beside each pair goes the sidecar
``{prefix}.meta.json`` (tokenizer hash and counts, see :mod:`domino.data.provenance`), written last.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterator, List, Optional, Sequence

import numpy as np
from tqdm import tqdm

from domino.atomic_files import remove_quietly, sweep_temporaries
from domino.data.builtin_corpora import builtin_corpus_bytes, builtin_documents
from domino.data.errors import DataError
from domino.data.indexed_dataset import IndexedDatasetWriter, index_file_path, temporary_paths, token_dtype
from domino.data.limits import MAX_DOCUMENT_CHARS, MAX_LINE_BYTES
from domino.data.provenance import (DatasetMeta, check_output_name, file_sha256, meta_path, tokenizer_sha256,
                                   write_meta)
from domino.data.input_files import expand_inputs
from domino.data.text_inputs import BadLineCounter, Document, input_bytes, read_documents
from domino.data.tokenizer import Tokenizer, build_tokenizer

logger = logging.getLogger(__name__)

#: A batch handed to the tokenizer closes once it holds this many characters (or BATCH_DOCUMENTS documents).
BATCH_CHARS = 1 << 20
BATCH_DOCUMENTS = 2048


@dataclass
class PreprocessResult:
    """What a preprocess run wrote.

    Attributes:
        documents: documents written (per key; as in Megatron, documents without tokens are included as
            empty entries of the document index).
        tokens: tokens written over all keys (end-of-document ids included).
        seconds: wall-clock time of the whole run, tokenizer loading included.
        prefixes: json key -> dataset prefix (path without ``.bin``/``.idx``), usable as ``--data-path``.
        vocab_size: the tokenizer's vocabulary size.
        tokenizer: the tokenizer's name (``gpt2`` or its path).
        idx_sha256: json key -> SHA-256 of the written ``.idx`` file.
        skipped_lines: bad input lines dropped under ``skip_bad_lines``.
        empty_documents: documents (of the first key) that encode to no tokens.
    """

    documents: int
    tokens: int
    seconds: float
    prefixes: Dict[str, str]
    vocab_size: int
    tokenizer: str
    idx_sha256: Dict[str, str]
    skipped_lines: int = 0
    empty_documents: int = 0
    eod: Optional[int] = field(default=None)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        """One line: documents, tokens, seconds, tokens/s (and what was skipped)."""
        line = (f"{self.documents} documents, {self.tokens} tokens in {self.seconds:.2f} s "
                f"({self.tokens_per_second:,.0f} tokens/s)")
        if self.skipped_lines:
            line += f", {self.skipped_lines} bad lines skipped"
        if self.empty_documents:
            line += f" ({self.empty_documents} of the documents are empty)"
        return line


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's dataset name for ``key``: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def _batches(documents: Iterator[Document]) -> Iterator[List[Document]]:
    batch: List[Document] = []
    chars = 0
    for document in documents:
        batch.append(document)
        chars += sum(len(t) if isinstance(t, str) else sum(map(len, t)) for t in document.texts)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCUMENTS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _pieces(text: str, max_chars: int) -> Iterator[str]:
    """``text`` in consecutive slices of at most ``max_chars``, each cut before its last space or newline
    when it has one, so that (as GPT-2's pre-tokenizer attaches a space to the word after it) the slices
    encode to the same tokens as the whole text in the common case."""
    start = 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
        end = cut if cut > start else end
        yield text[start:end]
        start = end
    yield text[start:]


def _encode(tokenizer: Tokenizer, texts: List[str], max_chars: int, dtype: np.dtype) -> List[np.ndarray]:
    """Token ids of each text; a text over ``max_chars`` is encoded slice by slice and the ids joined."""
    if all(len(text) <= max_chars for text in texts):
        return [np.asarray(ids, dtype=dtype) for ids in tokenizer.encode_batch(texts)]
    return [np.concatenate([np.asarray(tokenizer.encode_batch([piece])[0], dtype=dtype)
                            for piece in _pieces(text, max_chars)]) for text in texts]


def _encode_batch(tokenizer: Tokenizer, batch: List[Document], key_count: int, append_eod: bool, dtype: np.dtype,
                  max_chars: int = MAX_DOCUMENT_CHARS):
    """Encodes one batch as Megatron does; per key returns (tokens, sequence lengths, sequences per document).

    A text is one sequence; a list of texts (Megatron's sentences) is one sequence per non-empty item.
    The end-of-document id goes at the end of a document's last sequence; a document without tokens
    gets no sequence at all (an empty entry in the document index, as Megatron writes it).
    """
    out = []
    eod = np.asarray([tokenizer.eod], dtype=dtype)
    for k in range(key_count):
        pieces: List[str] = []
        counts: List[int] = []
        for document in batch:
            text = document.texts[k]
            sentences = [text] if isinstance(text, str) else list(text)
            pieces.extend(sentences)
            counts.append(len(sentences))
        encoded = _encode(tokenizer, pieces, max_chars, dtype)
        sequences: List[np.ndarray] = []
        per_document = np.zeros(len(batch), dtype=np.int64)
        position = 0
        for index, count in enumerate(counts):
            kept = [ids for ids in encoded[position:position + count] if len(ids)]
            position += count
            if kept and append_eod:
                kept[-1] = np.concatenate([kept[-1], eod])
            sequences.extend(kept)
            per_document[index] = len(kept)
        lengths = np.fromiter((len(ids) for ids in sequences), dtype=np.int64, count=len(sequences))
        flat = np.concatenate(sequences) if sequences else np.zeros(0, dtype=dtype)
        out.append((flat, lengths, per_document))
    return out


def _check_json_key(key: str) -> None:
    """A key becomes part of the output file name: no path separators, no ``..``, nothing empty."""
    separators = {"/", "\\", "\0", os.sep, os.altsep or "/"}
    if not key or any(sep in key for sep in separators) or ".." in key:
        raise DataError(f"--json-keys: key {key!r} may not be empty or contain a path separator or '..' "
                        "(it becomes part of the output file name)")


def _available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def _serial_tokenizer() -> Iterator[None]:
    """Each call encodes on the calling thread; the worker threads provide the parallelism."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _progress_bar(total: int, progress: Optional[bool]):
    enabled = sys.stderr.isatty() if progress is None else progress
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                desc="preprocess", dynamic_ncols=True)


def preprocess(inputs: Optional[Sequence[str]], output_prefix: str, tokenizer: str = "gpt2",
               json_keys: Sequence[str] = ("text",), append_eod: bool = True, workers: int = 1,
               skip_bad_lines: bool = False, builtin_corpus: Optional[str] = None,
               progress: Optional[bool] = None, txt_document_per_file: bool = False,
               max_document_chars: int = MAX_DOCUMENT_CHARS, max_line_bytes: int = MAX_LINE_BYTES) -> PreprocessResult:
    """Tokenises documents into Megatron-compatible indexed datasets.

    Args:
        inputs: ``.jsonl``/``.json``/``.txt`` files or glob patterns (None or empty with ``builtin_corpus``).
        output_prefix: output path prefix; files are ``{output_prefix}_{key}_document.{bin,idx}``.
        tokenizer: ``gpt2``, a ``tokenizer.json`` path or a tokenizer directory (see :func:`build_tokenizer`).
        json_keys: JSON keys holding the text; one dataset per key (``.txt`` inputs: exactly one key).
        append_eod: append the end-of-document id to every document.
        workers: threads that tokenise concurrently (each on its own core).
        skip_bad_lines: drop and count bad input lines instead of failing on the first one.
        builtin_corpus: name of a built-in corpus (see ``list_builtin_corpora()``) to use instead of inputs.
        progress: show a progress bar (default: only when stderr is a terminal).
        txt_document_per_file: a whole ``.txt`` file is one document (default: blank-line-separated blocks).
        max_document_chars: the most text the tokenizer gets in one call; a longer document (one huge JSON
            line, a ``.txt`` without blank lines) is encoded slice by slice into the same one document.
        max_line_bytes: the longest input line read (decompressed); a longer one is an error naming the file
            and line (skipped with ``skip_bad_lines``), read through in bounded blocks, never held whole.

    Returns:
        a :class:`PreprocessResult`.

    Raises:
        DataError: for bad arguments (before any work) or bad input (``file:line: reason``); nothing is
            left under the output names then.
    """
    start = time.perf_counter()
    json_keys = (json_keys,) if isinstance(json_keys, str) else tuple(json_keys)
    inputs = [inputs] if isinstance(inputs, str) else inputs
    if bool(inputs) == bool(builtin_corpus):
        raise DataError("give either input files or --builtin-corpus (exactly one of them)")
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise DataError(f"--json-keys must name distinct keys, got {list(json_keys)}")
    for key in json_keys:
        _check_json_key(key)
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    if max_document_chars < 1:
        raise DataError(f"--max-document-chars must be >= 1, got {max_document_chars}")
    if max_line_bytes < 1:
        raise DataError(f"--max-line-bytes must be >= 1, got {max_line_bytes}")
    if workers > _available_cpus():  # more threads than cores only adds memory (2 batches in flight each)
        logger.warning("--workers %d capped at the %d CPUs available", workers, _available_cpus())
        workers = _available_cpus()
    if not output_prefix or output_prefix.endswith(os.sep):
        raise DataError(f"--output-prefix must name a file prefix, got {output_prefix!r}")
    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    for prefix in prefixes.values():
        check_output_name(prefix)
    bad = BadLineCounter()
    if builtin_corpus:
        if json_keys != ("text",):
            raise DataError("--builtin-corpus documents have a single key; leave --json-keys at its default 'text'")
        total_bytes = builtin_corpus_bytes(builtin_corpus)
        documents = builtin_documents(builtin_corpus)
    else:
        files = expand_inputs(inputs)
        total_bytes = input_bytes(files)
        documents = read_documents(files, json_keys, txt_document_per_file, skip_bad_lines, bad, max_line_bytes)
    tok = build_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    for prefix in prefixes.values():  # what a killed run left; a live writer's temporaries are its own
        sweep_temporaries(temporary_paths(prefix) + [meta_path(prefix)])
    writers = {key: IndexedDatasetWriter(prefix, dtype) for key, prefix in prefixes.items()}
    written, empty, tokens = 0, 0, 0
    try:
        with _serial_tokenizer(), ThreadPoolExecutor(max_workers=workers) as pool, \
                _progress_bar(total_bytes, progress) as bar:
            pending: Deque = collections.deque()

            def drain_one() -> None:
                nonlocal written, empty, tokens
                future, nbytes = pending.popleft()
                for key, (flat, lengths, per_document) in zip(json_keys, future.result()):
                    writers[key].add_documents(flat, lengths, per_document)
                    tokens += len(flat)
                    if key == json_keys[0]:
                        written += len(per_document)
                        empty += int((per_document == 0).sum())
                bar.update(nbytes)
                rate = tokens / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(docs=written, tok_s=f"{rate:,.0f}", refresh=False)

            for batch in _batches(documents):
                pending.append((pool.submit(_encode_batch, tok, batch, len(json_keys), append_eod, dtype,
                                            max_document_chars),
                                sum(d.nbytes for d in batch)))
                while len(pending) > 2 * workers:  # keep every worker busy, bound memory
                    drain_one()
            while pending:
                drain_one()
        if tokens == 0:
            raise DataError("the input's documents hold no tokens; nothing to write")
        for writer in writers.values():
            remove_quietly(meta_path(writer.prefix))  # never an old sidecar beside the new pair
            writer.finalize()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    tokenizer_hash = tokenizer_sha256(tok)
    for writer in writers.values():
        write_meta(writer.prefix, DatasetMeta(
            tokenizer=tok.name, tokenizer_sha256=tokenizer_hash, vocab_size=tok.vocab_size, eod=tok.eod,
            dtype=str(dtype), documents=written, sequences=writer.sequences, tokens=writer.tokens))
    bad.log_summary()
    result = PreprocessResult(
        documents=written, tokens=tokens, seconds=time.perf_counter() - start, prefixes=prefixes,
        vocab_size=tok.vocab_size, tokenizer=tok.name,
        idx_sha256={key: file_sha256(index_file_path(prefix)) for key, prefix in prefixes.items()},
        skipped_lines=bad.count, empty_documents=empty, eod=tok.eod,
    )
    logger.info("preprocess: %s -> %s", result.summary(), ", ".join(f"{p}.bin/.idx" for p in prefixes.values()))
    return result
