"""Logic of the preprocess stage's first two steps: plan the shard groups, tokenise one group.

Plain Python, no kfp: the component bodies call :func:`plan_groups` and :func:`run_group`, and the tests
call them directly. The stage (``pipelines/preprocess_stage.py``) is::

    plan-preprocess      expand the inputs, name the dataset by its key, split the files into groups
    ParallelFor group:   preprocess   tokenise one group (or find it already done)
    merge-datasets       concatenate the groups in order (components/merge), write the Dataset manifest

Datasets live in the :class:`~domino.data.dataset_store.DatasetStore` on the shared volume, named by
:func:`~domino.data.provenance.dataset_key`, so that a run whose inputs and tokenizer have not changed
finds its dataset complete and tokenises nothing; each run tokenises into a build folder of its own and
publishes it under the key's lock (the rules are in :mod:`domino.data.dataset_store`).
"""

from __future__ import annotations

import bisect
import glob
import itertools
import json
import os
from typing import Any, Dict, List, Sequence, Tuple
from urllib.parse import urlparse

from components.merge.step import run_merge
from domino.data.dataset_store import Build, DatasetStore


def resolve_inputs(input_uri: str) -> List[str]:
    """Splits a comma-separated list of paths, globs, directories or ``file://`` URIs into local paths.

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
        if not glob.has_magic(path) and not os.path.exists(path):
            raise ValueError(f"input_uri: {path} does not exist")
        paths.append(path)
    if not paths:
        raise ValueError(f"input_uri: {input_uri!r} names no file")
    return paths


def parse_keys(json_keys: str) -> Tuple[str, ...]:
    """``"text,title"`` -> ``("text", "title")``; raises ValueError when it names no key."""
    keys = tuple(key.strip() for key in json_keys.split(",") if key.strip())
    if not keys:
        raise ValueError(f"json_keys: {json_keys!r} names no key")
    return keys


def split_in_groups(sizes: Sequence[int], groups: int) -> List[Tuple[int, int]]:
    """Contiguous ``[start, end)`` index ranges over ``sizes``, at most ``groups`` of them, balanced by bytes.

    The ranges keep the files' order, so concatenating the groups' datasets in order gives the dataset of
    all files in one run. Every range holds at least one file.
    """
    count = min(groups, len(sizes))
    cumulative = list(itertools.accumulate(sizes, initial=0))  # cumulative[i]: bytes of the first i files
    bounds = [0]
    for k in range(1, count):
        cut = bisect.bisect_left(cumulative, sum(sizes) * k / count)  # first file past k/count of the bytes
        bounds.append(max(bounds[-1] + 1, min(cut, len(sizes) - (count - k))))
    bounds.append(len(sizes))
    return list(zip(bounds[:-1], bounds[1:]))


def plan_groups(shared_root: str, corpus: str = "shakespeare", input_uri: str = "", tokenizer: str = "gpt2",
                json_keys: str = "text", groups: int = 1) -> List[Dict[str, Any]]:
    """Expands the inputs, computes the dataset key, and splits the files into at most ``groups`` groups.

    Args:
        shared_root: Shared volume root (the :class:`DatasetStore` lives under it).
        corpus: Built-in corpus, used when ``input_uri`` is empty (always one group).
        input_uri: Comma-separated paths, globs, directories or ``file://`` URIs of input files.
        tokenizer: Tokenizer name or file; its content is part of the key.
        json_keys: Comma-separated JSON keys (Parquet columns) to tokenise.
        groups: How many groups (tasks) to split the files into; fewer when there are fewer files.

    Returns:
        One dict per group: ``index``, ``count``, ``dataset_key``, ``group_key``, ``inputs`` (paths),
        ``builtin`` (corpus name or ""), ``output_prefix`` (the whole dataset's prefix when there is one
        group, so nothing needs copying), ``source`` (for the manifest).

    Raises:
        ValueError / DataError: bad arguments or inputs, naming them, before any task is started.
    """
    from domino.data.builtin_corpora import builtin_corpus_bytes
    from domino.data.provenance import dataset_key, file_identity, tokenizer_sha256
    from domino.data.input_files import expand_inputs
    from domino.data.tokenizer import build_tokenizer

    keys = parse_keys(json_keys)
    if groups < 1:
        raise ValueError(f"preprocess_groups: {groups} must be at least 1")
    store = DatasetStore(shared_root)
    tokenizer_hash = tokenizer_sha256(build_tokenizer(tokenizer))
    if input_uri.strip():
        files = expand_inputs(resolve_inputs(input_uri))
        sources = [file_identity(path) for path in files]
        source = ",".join(files) if len(files) <= 8 else f"{len(files)} files: {files[0]} ... {files[-1]}"
        ranges = split_in_groups([s["size"] for s in sources], groups)
    elif corpus:
        files, sources, source = [], [{"builtin": corpus, "bytes": builtin_corpus_bytes(corpus)}], f"builtin:{corpus}"
        ranges = [(0, 1)]
    else:
        raise ValueError("preprocess: give input_uri or a built-in corpus name")
    key = dataset_key(sources, tokenizer_hash, keys)
    plan = []
    for index, (start, end) in enumerate(ranges):
        group_key = key if len(ranges) == 1 else dataset_key(sources[start:end], tokenizer_hash, keys)
        plan.append({
            "index": index, "count": len(ranges), "dataset_key": key, "group_key": group_key,
            "inputs": files[start:end], "builtin": "" if files else corpus, "source": source, "tokenizer": tokenizer,
            "json_keys": ",".join(keys),
            "output_prefix": store.dataset_prefix(key) if len(ranges) == 1 else store.part_prefix(group_key),
        })
    return plan


def run_group(shared_root: str, group: Dict[str, Any], tokenizer: str = "gpt2", json_keys: str = "text",
              workers: int = 1, reuse: bool = True) -> Dict[str, Any]:
    """Tokenises one group of the plan, unless its dataset (or the whole dataset) is complete already.

    Returns:
        The group's result for the merge: ``index``, ``count``, ``dataset_key``, ``prefixes`` per key,
        ``documents``, ``tokens``, ``tokenizer``, ``vocab_size``, ``idx_sha256``, ``source``, and
        ``reused`` (nothing was tokenised).
    """
    from domino.data.preprocess import preprocess

    # The plan names the JSON keys it keyed the dataset with; they win over the argument.
    keys = parse_keys(group.get("json_keys") or json_keys)
    if workers < 1:
        raise ValueError(f"preprocess_workers: {workers} must be at least 1")
    header = {k: group[k] for k in ("index", "count", "dataset_key", "source")}
    store = DatasetStore(shared_root)
    if reuse:
        for prefix in (store.dataset_prefix(group["dataset_key"]), group["output_prefix"]):
            record = store.read_record(prefix)
            if record is not None:
                return {**record, **header, "reused": True}
    # The plan names the tokenizer it keyed the dataset with; it wins over the argument.
    tokenizer = group.get("tokenizer") or tokenizer
    with Build(group["output_prefix"]) as build:  # a folder of this run's own, published below
        result = preprocess(group["inputs"] or None, build.prefix, tokenizer=tokenizer, json_keys=keys,
                            workers=workers, builtin_corpus=group["builtin"] or None, progress=False)
        record = build.publish({
            "prefixes": dict(result.prefixes), "documents": int(result.documents), "tokens": int(result.tokens),
            "tokenizer": str(result.tokenizer), "vocab_size": int(result.vocab_size),
            "idx_sha256": result.idx_sha256[keys[0]], "key": group["group_key"],
        }, replace=not reuse)
    return {**record, **header, "reused": False}


def run_preprocess(manifest_path: str, shared_root: str, corpus: str = "shakespeare", input_uri: str = "",
                   tokenizer: str = "gpt2", json_keys: str = "text", workers: int = 1, groups: int = 1,
                   reuse: bool = True) -> Dict[str, Any]:
    """The whole stage in this process: plan, every group in turn, merge; writes the Dataset manifest.

    What the pipeline does with a ``ParallelFor`` (see ``pipelines/preprocess_stage.py``), for tests and
    single-machine use. Arguments as for :func:`plan_groups`, :func:`run_group` and
    :func:`components.merge.step.run_merge`; returns the manifest.
    """
    plan = plan_groups(shared_root, corpus=corpus, input_uri=input_uri, tokenizer=tokenizer, json_keys=json_keys,
                       groups=groups)
    parts = [json.dumps(run_group(shared_root, group, tokenizer=tokenizer, json_keys=json_keys, workers=workers,
                                  reuse=reuse)) for group in plan]
    return run_merge(manifest_path, shared_root, parts, reuse=reuse)
