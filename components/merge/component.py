"""kfp wrapper of the merge step (see ``step.py`` for the logic and ``README.md`` for usage)."""

from typing import List, Optional

from kfp import dsl
from kfp.dsl import Dataset, Output

from components import default_image


def merge_datasets(
    dataset: Output[Dataset],
    shared_root: str,
    parts: List[str],
    reuse: bool = True,
):
    """Concatenates the shard groups' datasets in order into the run's dataset.

    Args:
        dataset: Manifest naming the tokenized files on the shared volume; its metadata holds prefix,
            documents, tokens, tokenizer, vocab_size, idx_sha256, dataset_key, reused, groups, groups_tokenized.
        shared_root: Mount path of the shared volume (or a local folder when run locally).
        parts: The preprocess tasks' results (dsl.Collected over the ParallelFor).
        reuse: Reuse a complete dataset of the same key instead of merging again.
    """
    from components.merge.step import run_merge

    dataset.metadata.update(run_merge(dataset.path, shared_root, parts, reuse=reuse))


def build(image: Optional[str] = None):
    """The merge-datasets component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(merge_datasets, base_image=image or default_image(), install_kfp_package=False)
