"""What a dataset was made from: the ``{prefix}.meta.json`` sidecar and the keys that identify inputs.

Megatron's ``.idx`` records the token dtype but not the tokenizer, so two datasets of the same dtype
made with different tokenizers look alike. ``domino preprocess`` therefore writes, beside each
``.bin``/``.idx`` pair, a small JSON sidecar naming the tokenizer (by the SHA-256 of its serialised
form, which changes with any vocabulary, merge or normaliser change), its end-of-document id and the
dataset's counts. ``domino merge-datasets`` refuses to concatenate datasets whose sidecars disagree.
Megatron ignores the sidecar, and datasets without one (written by Megatron) still merge, by dtype only.

:func:`dataset_key` names a preprocessed dataset by everything that determines its bytes: the inputs'
identity (absolute path, size, modification time, inode and status-change time of every file, in order;
not their contents, which would mean reading a terabyte corpus to decide whether to read it), the tokenizer's hash and the
preprocessing options. The pipeline stores datasets under that key and reuses them (``docs/pipeline.md``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from domino.atomic_files import atomic_write_text, name_too_long
from domino.data.errors import DataError

if TYPE_CHECKING:  # only for annotations: the index cache uses this module without loading a tokenizer
    from domino.data.tokenizer import Tokenizer

#: Bump when preprocessing the same input with the same tokenizer would write different bytes, so that
#: datasets stored under the old keys are no longer reused.
PREPROCESS_FORMAT = 1


@dataclass
class DatasetMeta:
    """The sidecar of one ``.bin``/``.idx`` pair.

    Attributes:
        tokenizer: The tokenizer's name (``gpt2`` or the path it was loaded from), for people.
        tokenizer_sha256: SHA-256 of the tokenizer's serialised ``tokenizer.json`` form; what merges compare.
        vocab_size: The tokenizer's vocabulary size.
        eod: The end-of-document id.
        dtype: The token dtype (``uint16`` or ``int32``).
        documents: Documents (entries of the document index).
        sequences: Sequences (entries of ``sizes``).
        tokens: Tokens in ``.bin``.
    """

    tokenizer: str
    tokenizer_sha256: str
    vocab_size: int
    eod: int
    dtype: str
    documents: int
    sequences: int
    tokens: int


def meta_path(prefix: str) -> str:
    """``{prefix}.meta.json``."""
    return prefix + ".meta.json"


def check_output_name(prefix: str, flag: str = "--output-prefix") -> None:
    """Fails before any work when a dataset of ``prefix`` could not be written for the length of its names (the
    sidecar's is the longest, and it is written last).

    Raises:
        DataError: naming ``flag`` and the name.
    """
    problem = name_too_long(meta_path(prefix))
    if problem:
        raise DataError(f"{flag}: output {meta_path(prefix)}: {problem}")


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical serialisation (Hugging Face ``tokenizer.json`` text)."""
    return hashlib.sha256(tokenizer.backend.to_str().encode("utf-8")).hexdigest()


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes, read in 1 MB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_meta(prefix: str, meta: DatasetMeta) -> None:
    """Writes the sidecar atomically."""
    atomic_write_text(meta_path(prefix), json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n")


def read_meta(prefix: str) -> Optional[DatasetMeta]:
    """The sidecar of ``prefix``, or None when there is none.

    Raises:
        DataError: the sidecar exists but is not valid, naming it.
    """
    path = meta_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return DatasetMeta(**json.load(handle))
    except (OSError, ValueError, TypeError) as error:
        raise DataError(f"{path}: not a dataset sidecar ({error})") from None


def file_identity(path: str) -> Dict[str, Any]:
    """``{"path", "size", "mtime_ns", "inode", "ctime_ns"}`` of ``path`` (absolute path), without reading it.

    The inode changes when a file is replaced (written elsewhere and renamed over, as most tools do), and
    the status-change time on every write, ``touch -m`` or ``os.utime`` included: a file rewritten with the
    same size and its old mtime restored still gets a new key. (``chmod`` or a rename change the ctime too,
    which costs one needless re-tokenisation.) The device number is left out: NFS clients number a mount
    each their own way, and the key must be the same on every node.
    """
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "inode": stat.st_ino, "ctime_ns": stat.st_ctime_ns}


def dataset_key(sources: Sequence[Dict[str, Any]], tokenizer_hash: str, json_keys: Sequence[str],
                append_eod: bool = True, txt_document_per_file: bool = False) -> str:
    """A 24-hex-digit key naming the dataset that preprocessing ``sources`` (in order) would write.

    Args:
        sources: one entry per input, e.g. :func:`file_identity` dicts or ``{"builtin": name, ...}``.
        tokenizer_hash: :func:`tokenizer_sha256` of the tokenizer.
        json_keys: the keys (and so the output datasets), in order.
        append_eod: whether documents end with the end-of-document id.
        txt_document_per_file: whether a whole ``.txt`` file is one document.
    """
    description = {"format": PREPROCESS_FORMAT, "sources": list(sources), "tokenizer": tokenizer_hash,
                   "json_keys": list(json_keys), "append_eod": bool(append_eod),
                   "txt_document_per_file": bool(txt_document_per_file)}
    text = json.dumps(description, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def check_same_tokenizer(prefixes: Sequence[str], metas: Sequence[Optional[DatasetMeta]]) -> List[str]:
    """Checks that every sidecar names the same tokenizer; returns the prefixes that have none.

    Raises:
        DataError: naming the first two datasets whose tokenizer, vocabulary size or end-of-document id differ.
    """
    first = next(((p, m) for p, m in zip(prefixes, metas) if m is not None), None)
    for prefix, meta in zip(prefixes, metas):
        if meta is None or first is None:
            continue
        for field in ("tokenizer_sha256", "vocab_size", "eod"):
            if getattr(meta, field) != getattr(first[1], field):
                raise DataError(
                    f"{prefix} and {first[0]} were made with different tokenizers ({field}: "
                    f"{getattr(meta, field)} [{meta.tokenizer}] vs {getattr(first[1], field)} "
                    f"[{first[1].tokenizer}]); datasets of different tokenizers cannot be merged")
    return [prefix for prefix, meta in zip(prefixes, metas) if meta is None]
