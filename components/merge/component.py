"""kfp declaration and glue of the merge step (logic in ``step.py``, usage in ``README.md``).

The kfp function, ``components.kfp_functions.merge_datasets``, is generated from :data:`COMPONENTS` (see
``components/declare.py``).
"""

from dataclasses import dataclass
from typing import Any, List

from kfp import dsl

from components.declare import Component, Input, settings_from_values
from components.merge.step import run_merge
from components.run_settings import ReuseSettings, VolumeSettings


@dataclass(kw_only=True)
class MergeSettings(ReuseSettings, VolumeSettings):
    """Parameters of the merge-datasets step."""


COMPONENTS = (Component(
    function="merge_datasets",
    summary="Concatenates the shard groups' datasets in order into the run's dataset.",
    settings=MergeSettings,
    run="components.merge.component:run",
    inputs=(
        Input("dataset", "Output[Dataset]", "Manifest naming the tokenized files on the shared volume; its metadata "
              "holds prefix, documents, tokens, tokenizer, vocab_size, idx_sha256, dataset_key, reused, groups, "
              "groups_tokenized."),
        Input("parts", "List[str]", "The preprocess tasks' results (dsl.Collected over the ParallelFor)."),
    ),
),)


def run(dataset: Any, parts: List[str], **values: Any) -> None:
    """The merge-datasets component's body."""
    s = settings_from_values(MergeSettings, values)
    dataset.metadata.update(run_merge(dataset.path, s.shared_root, parts, reuse=s.reuse_dataset))
