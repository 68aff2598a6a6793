"""kfp wrappers of the plan and per-group preprocess steps (logic in ``step.py``, usage in ``README.md``)."""

from typing import List, Optional

from kfp import dsl

from components import default_image


def plan_preprocess(
    shared_root: str,
    corpus: str = "shakespeare",
    input_uri: str = "",
    tokenizer: str = "gpt2",
    json_keys: str = "text",
    groups: int = 1,
) -> List[str]:
    """Expands the inputs, names the dataset by its key, and splits the files into shard groups.

    Args:
        shared_root: Mount path of the shared volume (or a local folder when run locally).
        corpus: Built-in corpus (shakespeare, kjv, ...) used when ``input_uri`` is empty.
        input_uri: Comma-separated paths, globs, directories or file:// URIs of .jsonl/.txt (optionally .gz/.zst) or .parquet files.
        tokenizer: Tokenizer name or tokenizer.json path.
        json_keys: Comma-separated JSON keys (Parquet columns) to tokenize.
        groups: Shard groups, one preprocess task each (fewer when there are fewer files).

    Returns:
        One JSON object per group, the items of the stage's ParallelFor.
    """
    import json

    from components.preprocess.step import plan_groups

    plan = plan_groups(shared_root, corpus=corpus, input_uri=input_uri, tokenizer=tokenizer, json_keys=json_keys,
                       groups=groups)
    return [json.dumps(group, sort_keys=True) for group in plan]


def preprocess(
    shared_root: str,
    group: str,
    tokenizer: str = "gpt2",
    json_keys: str = "text",
    workers: int = 1,
    reuse: bool = True,
) -> str:
    """Tokenizes one shard group into ``.bin/.idx`` on the shared volume, unless it is done already.

    Args:
        shared_root: Mount path of the shared volume (or a local folder when run locally).
        group: One item of the plan (JSON).
        tokenizer: Tokenizer name or tokenizer.json path, when the group does not name one (the plan's groups do).
        json_keys: Comma-separated JSON keys to tokenize.
        workers: Tokenizer threads.
        reuse: Reuse a complete dataset of the same key instead of tokenizing again.

    Returns:
        The group's result (JSON) for the merge step.
    """
    import json

    from components.preprocess.step import run_group

    return json.dumps(run_group(shared_root, json.loads(group), tokenizer=tokenizer, json_keys=json_keys,
                                workers=workers, reuse=reuse), sort_keys=True)


def build_plan(image: Optional[str] = None):
    """The plan-preprocess component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(plan_preprocess, base_image=image or default_image(), install_kfp_package=False)


def build(image: Optional[str] = None):
    """The preprocess (one shard group) component running in ``image``."""
    return dsl.component(preprocess, base_image=image or default_image(), install_kfp_package=False)
