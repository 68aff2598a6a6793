"""Where a pipeline run keeps its files on the shared volume.

Every step of one run derives the same paths from two strings, the shared root (the PVC's mount path,
or a local folder) and the run id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``), so two runs never collide and a
retried step finds its own earlier output. (The training job's name comes from
``domino.launch.naming.job_name`` with the same run id.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from domino.data.dataset_store import DatasetStore


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


__all__ = ["DatasetStore", "RunLayout"]  # the datasets' layout and rules: domino/data/dataset_store.py
