"""kfp declarations and glue of the plan and per-group preprocess steps (logic in ``step.py``, usage in
``README.md``).

The kfp functions, ``components.kfp_functions.plan_preprocess`` and ``.preprocess``, are generated from
:data:`COMPONENTS` (see ``components/declare.py``).
"""

import json
from dataclasses import dataclass
from typing import Any, List

from components.declare import Component, Input, settings_from_values
from components.preprocess.step import plan_groups, run_group
from components.run_settings import CorpusSettings, ReuseSettings, VolumeSettings


@dataclass(kw_only=True)
class PlanSettings(CorpusSettings, VolumeSettings):
    """Parameters of the plan-preprocess step."""

    preprocess_groups: int = 1
    """Shard groups tokenized in parallel, one task each, then merged (fewer when there are fewer files)."""


@dataclass(kw_only=True)
class GroupSettings(ReuseSettings, VolumeSettings):
    """Parameters of one preprocess (shard group) task."""

    preprocess_workers: int = 1
    """Tokenizer threads of each preprocess task."""


COMPONENTS = (
    Component(
        function="plan_preprocess",
        summary="Expands the inputs, names the dataset by its key, and splits the files into shard groups.",
        settings=PlanSettings,
        run="components.preprocess.component:run_plan",
        inputs=(Input("tokenizer", "str", "The tokenizer (train-tokenizer's output); its content is part of the "
                      "dataset key."),),
        returns=("List[str]", "One JSON object per group, the items of the stage's ParallelFor."),
    ),
    Component(
        function="preprocess",
        summary="Tokenizes one shard group into ``.bin/.idx`` on the shared volume, unless it is done already.",
        settings=GroupSettings,
        run="components.preprocess.component:run_one_group",
        inputs=(Input("group", "str", "One item of the plan (JSON; it names the tokenizer and the JSON keys)."),),
        returns=("str", "The group's result (JSON) for the merge step."),
    ),
)


def run_plan(tokenizer: str, **values: Any) -> List[str]:
    """The plan-preprocess component's body."""
    s = settings_from_values(PlanSettings, values)
    plan = plan_groups(s.shared_root, corpus=s.corpus, input_uri=s.input_uri, tokenizer=tokenizer,
                       json_keys=s.json_keys, groups=s.preprocess_groups)
    return [json.dumps(group, sort_keys=True) for group in plan]


def run_one_group(group: str, **values: Any) -> str:
    """The preprocess component's body."""
    s = settings_from_values(GroupSettings, values)
    return json.dumps(run_group(s.shared_root, json.loads(group), workers=s.preprocess_workers,
                                reuse=s.reuse_dataset), sort_keys=True)
