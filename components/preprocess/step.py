"""Logic of the preprocess step: raw text (files or a built-in corpus) to ``.bin/.idx`` on the shared volume.

Plain Python, no kfp: the component body calls :func:`run_preprocess` and the tests call it directly.
The tokenized files go to the run's data folder on the shared volume, because the training job's pods
read them from there; the kfp ``Dataset`` artifact is a small JSON manifest naming them.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

from components.layout import RunLayout
from components.manifest import write_manifest


def resolve_inputs(input_uri: str) -> List[str]:
    """Splits a comma-separated list of paths or ``file://`` URIs into local paths.

    Raises:
        ValueError: a URI with another scheme, or a path that does not exist, named in the message.
    """
    paths = []
    for item in (part.strip() for part in input_uri.split(",")):
        if not item:
            continue
        parsed = urlparse(item)
        if parsed.scheme in ("", "file"):
            path = parsed.path if parsed.scheme == "file" else item
        else:
            raise ValueError(
                f"input_uri: {item!r} uses scheme '{parsed.scheme}'; give a path on the shared volume or a file:// URI"
            )
        if not os.path.exists(path):
            raise ValueError(f"input_uri: {path} does not exist")
        paths.append(path)
    if not paths:
        raise ValueError(f"input_uri: {input_uri!r} names no file")
    return paths


def run_preprocess(
    manifest_path: str,
    shared_root: str,
    run_id: str,
    corpus: str = "shakespeare",
    input_uri: str = "",
    tokenizer: str = "gpt2",
    json_keys: str = "text",
    workers: int = 1,
) -> Dict[str, Any]:
    """Tokenizes the input into the run's data folder and writes the dataset manifest.

    Args:
        manifest_path: Where to write the manifest (the ``Dataset`` artifact's path).
        shared_root: Shared volume root (see :class:`components.layout.RunLayout`).
        run_id: Pipeline run id.
        corpus: Built-in corpus name, used when ``input_uri`` is empty.
        input_uri: Comma-separated paths or ``file://`` URIs of JSON-lines or text files.
        tokenizer: Tokenizer name or file (``gpt2`` works offline).
        json_keys: Comma-separated JSON keys to tokenize; the first one is the training data.
        workers: Tokenizer worker processes.

    Returns:
        The manifest: ``prefix`` (the training ``--data-path``), ``prefixes`` per key, ``documents``,
        ``tokens``, ``tokenizer``, ``vocab_size``, ``idx_sha256`` (of the prefix's index), ``source``.
    """
    from domino.data.preprocess import preprocess

    keys = tuple(key.strip() for key in json_keys.split(",") if key.strip())
    if not keys:
        raise ValueError(f"json_keys: {json_keys!r} names no key")
    if workers < 1:
        raise ValueError(f"workers: {workers} must be at least 1")
    inputs: Optional[List[str]] = resolve_inputs(input_uri) if input_uri.strip() else None
    if inputs is None and not corpus:
        raise ValueError("preprocess: give input_uri or a built-in corpus name")
    source = ",".join(inputs) if inputs else f"builtin:{corpus}"
    layout = RunLayout(shared_root, run_id)
    os.makedirs(layout.data_dir, exist_ok=True)
    output_prefix = os.path.join(layout.data_dir, "corpus")
    result = preprocess(
        inputs,
        output_prefix,
        tokenizer=tokenizer,
        json_keys=keys,
        workers=workers,
        builtin_corpus=None if inputs else corpus,
    )
    manifest = {
        "prefix": result.prefixes[keys[0]],
        "prefixes": dict(result.prefixes),
        "documents": int(result.documents),
        "tokens": int(result.tokens),
        "tokenizer": str(result.tokenizer),
        "vocab_size": int(result.vocab_size),
        "idx_sha256": result.idx_sha256[keys[0]],
        "source": source,
    }
    write_manifest(manifest_path, manifest)
    return manifest

