"""Logic of the merge step: concatenate the shard groups' datasets in order and write the Dataset manifest.

Plain Python, no kfp. The groups' results arrive as ``dsl.Collected`` values, whose order is not relied
on: they are sorted by their ``index``. The whole dataset is complete once its record exists
(:meth:`domino.data.dataset_store.Build.publish`); a run that finds it complete merges nothing and says so
in the manifest (``reused: true``).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence

from components.manifest import write_manifest
from domino.data.dataset_store import Build, DatasetStore


def _ordered(parts: Sequence[str]) -> List[Dict[str, Any]]:
    results = sorted((json.loads(part) for part in parts), key=lambda r: r["index"])
    if not results:
        raise ValueError("merge: no shard group results")
    count, key = results[0]["count"], results[0]["dataset_key"]
    if [r["index"] for r in results] != list(range(count)) or {r["dataset_key"] for r in results} != {key}:
        raise ValueError(f"merge: expected the results of groups 0..{count - 1} of dataset {key}, got "
                         f"{[(r['index'], r['dataset_key']) for r in results]}")
    return results


def run_merge(manifest_path: str, shared_root: str, parts: Sequence[str], reuse: bool = True) -> Dict[str, Any]:
    """Merges the groups (unless the dataset is complete already) and writes the manifest.

    Args:
        manifest_path: Where to write the manifest (the ``Dataset`` artifact's path).
        shared_root: Shared volume root.
        parts: The preprocess tasks' JSON results, one per group, in any order.
        reuse: Reuse a complete dataset of the same key (False: merge again).

    Returns:
        The manifest: ``prefix`` (the training ``--data-path``), ``prefixes`` per key, ``documents``,
        ``tokens``, ``tokenizer``, ``vocab_size``, ``idx_sha256`` (of the prefix's index), ``source``,
        ``dataset_key``, ``reused`` (the dataset was found complete: nothing tokenised or merged this
        run), ``groups`` and ``groups_tokenized`` (groups tokenised this run; the others were found done).
    """
    from domino.data.merge import merge_datasets
    from domino.data.provenance import file_sha256

    results = _ordered(parts)
    first = results[0]
    store = DatasetStore(shared_root)
    output_prefix = store.dataset_prefix(first["dataset_key"])
    tokenized = sum(1 for r in results if not r["reused"])
    if len(results) == 1:  # the only group is the whole dataset: its task found or published it
        record, reused = first, bool(first["reused"])
    else:
        record = store.read_record(output_prefix) if reuse else None
        reused = record is not None and tokenized == 0
    if record is None:
        with Build(output_prefix) as build:  # a folder of this run's own, published below
            prefixes = {}
            for json_key in first["prefixes"]:
                prefixes[json_key] = f"{build.prefix}_{json_key}_document"
                merge_datasets([r["prefixes"][json_key] for r in results], prefixes[json_key])
            record = build.publish({
                "prefixes": prefixes, "documents": sum(r["documents"] for r in results),
                "tokens": sum(r["tokens"] for r in results), "tokenizer": first["tokenizer"],
                "vocab_size": first["vocab_size"], "idx_sha256": file_sha256(next(iter(prefixes.values())) + ".idx"),
                "key": first["dataset_key"],
            }, replace=not reuse)
    prefixes = record["prefixes"]
    manifest = {
        "prefix": prefixes[next(iter(prefixes))], "prefixes": dict(prefixes), "documents": int(record["documents"]),
        "tokens": int(record["tokens"]), "tokenizer": record["tokenizer"], "vocab_size": int(record["vocab_size"]),
        "idx_sha256": record["idx_sha256"], "source": first["source"], "dataset_key": first["dataset_key"],
        "reused": reused, "groups": len(results), "groups_tokenized": tokenized,
    }
    write_manifest(manifest_path, manifest)
    return manifest
