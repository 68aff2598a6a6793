"""Where a pipeline run keeps its files on the shared volume.

Every step of one run derives the same paths from two strings, the shared root (the PVC's mount path,
or a local folder) and the run id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``), so two runs never collide and a
retried step finds its own earlier output. (The training job's name comes from
``domino.launch.naming.job_name`` with the same run id.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from domino.atomic_files import atomic_write_text


@dataclass(frozen=True)
class RunLayout:
    """Paths of one pipeline run under the shared root.

    Attributes:
        root: The shared root (the PVC mount path in a cluster, a local folder otherwise).
        run_id: The pipeline run's unique id.
    """

    root: str
    run_id: str

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("shared_root: empty; give the PVC mount path or a local folder")
        if not self.run_id or "/" in self.run_id or self.run_id in (".", ".."):
            raise ValueError(f"run_id: {self.run_id!r} is not usable as a folder name")

    @property
    def run_dir(self) -> str:
        """``<root>/runs/<run_id>``: everything this run writes."""
        return os.path.join(self.root, "runs", self.run_id)

    @property
    def data_dir(self) -> str:
        """Tokenized ``.bin/.idx`` files of this run."""
        return os.path.join(self.run_dir, "data")

    @property
    def checkpoint_dir(self) -> str:
        """The training job's ``--save`` directory."""
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def metrics_file(self) -> str:
        """The training job's ``--metrics-file`` (JSON lines)."""
        return os.path.join(self.run_dir, "metrics.jsonl")

    @property
    def registry_path(self) -> str:
        """The promotion registry shared by all runs: ``<root>/promoted.json``."""
        return os.path.join(self.root, "promoted.json")



@dataclass(frozen=True)
class DatasetStore:
    """Preprocessed datasets kept across runs on the shared volume, named by their dataset key.

    ``<root>/datasets/<key>/corpus_<json key>_document.{bin,idx}`` is a whole dataset and
    ``<root>/datasets/parts/<group key>/part_<json key>_document.{bin,idx}`` the output of one shard
    group before the merge. Each is complete once its record (a JSON file written last, atomically)
    exists; a run whose key is already complete reuses it instead of tokenising again. The keys come
    from :func:`domino.data.provenance.dataset_key` (input files' names, sizes and mtimes, tokenizer).

    Attributes:
        root: The shared root.
    """

    root: str

    def dataset_prefix(self, key: str) -> str:
        """Output prefix of the whole dataset ``key``."""
        return os.path.join(self.root, "datasets", key, "corpus")

    def part_prefix(self, group_key: str) -> str:
        """Output prefix of one shard group's dataset."""
        return os.path.join(self.root, "datasets", "parts", group_key, "part")

    @staticmethod
    def record_path(output_prefix: str) -> str:
        """The completion record of the dataset written under ``output_prefix``."""
        return output_prefix + ".record.json"

    @classmethod
    def read_record(cls, output_prefix: str) -> Optional[Dict[str, Any]]:
        """The record of the dataset under ``output_prefix`` if it and all its files exist, else None."""
        from domino.data.indexed_dataset import dataset_exists

        try:
            with open(cls.record_path(output_prefix), encoding="utf-8") as handle:
                record = json.load(handle)
        except (OSError, ValueError):
            return None
        prefixes = record.get("prefixes") or {}
        return record if prefixes and all(dataset_exists(p) for p in prefixes.values()) else None

    @classmethod
    def write_record(cls, output_prefix: str, record: Dict[str, Any]) -> None:
        """Marks the dataset under ``output_prefix`` complete (written last, atomically)."""
        atomic_write_text(cls.record_path(output_prefix), json.dumps(record, indent=2, sort_keys=True) + "\n")
