"""The interleaved schedule's flags: Megatron's three spellings of the chunk count, its rules, refused in one line
before any work, and the same chunk count in what `domino estimate` and the launcher's layout check read.

Megatron-LM (``megatron/training/arguments.py`` at d98e8a64): ``--num-layers-per-virtual-pipeline-stage N`` gives
``v = num_layers / PP / N`` (the layers divisible by PP, the layers per stage by N), at most one of it and
``--num-virtual-stages-per-pipeline-rank``, interleaving needs PP > 1; its schedule
(``megatron/core/pipeline_parallel/schedules.py``) needs the micro-batches a multiple of PP at the default group
size.
"""

from __future__ import annotations

import re

import pytest

from domino.config import ConfigError, config_from_args, parse_config
from domino.config.estimate import candidate_layouts, config_with_layout, estimate_layout, layout_of
from domino.config.validate import validate
from domino.launch.pretrain_flags import parse_pretrain_args

SHAPE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--vocab-size", "512", "--micro-batch-size", "1"]
PP2 = [*SHAPE, "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]


@pytest.mark.parametrize("flags, chunks", [
    (["--num-layers-per-virtual-pipeline-stage", "2"], 2),  # 8 layers / PP 2 / 2 per chunk
    (["--num-layers-per-virtual-pipeline-stage", "1"], 4),
    (["--num-virtual-stages-per-pipeline-rank", "4"], 4),
    (["--virtual-pipeline-model-parallel-size", "2"], 2),
    ([], None),
])
def test_each_spelling_sets_the_one_field(flags, chunks):
    assert parse_config([*PP2, *flags], world_size=2).parallel.virtual_pipeline_model_parallel_size == chunks


@pytest.mark.parametrize("flags, message", [
    (["--num-layers-per-virtual-pipeline-stage", "3"],
     "--num-layers-per-virtual-pipeline-stage 3: --num-layers 8 / --pipeline-model-parallel-size 2 is not"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--virtual-pipeline-model-parallel-size", "2"],
     "mutually exclusive"),
    (["--virtual-pipeline-model-parallel-size", "3"], "4 layers per stage do not split into 3 virtual stages"),
    (["--virtual-pipeline-model-parallel-size", "0"], "--virtual-pipeline-model-parallel-size must be >= 1"),
    (["--global-batch-size", "6", "--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size",
      "2"], "--global-batch-size 6: the interleaved schedule needs the micro-batches per step (6"),
    (["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "2"],
     "the interleaved schedule needs --pipeline-model-parallel-size >= 2, got 1"),
    (["--train-samples", "64", "--rampup-batch-size", "4", "2", "16", "--virtual-pipeline-model-parallel-size", "2"],
     "the global batch 6 the batch-size schedule reaches: the interleaved schedule needs"),
])
def test_what_the_interleaved_schedule_cannot_run_is_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        parse_config([*PP2, *flags], world_size=4)
    assert "\n" not in str(error.value)


def test_estimate_and_layout_search_see_the_chunks_and_list_only_what_pretrain_accepts():
    config = parse_config([*PP2, "--num-layers-per-virtual-pipeline-stage", "2"], world_size=2)
    # The launcher parses a job's pretrain arguments as `domino pretrain` does (its layout and memory checks).
    launched = config_from_args(parse_pretrain_args([*PP2, "--num-layers-per-virtual-pipeline-stage", "2"]),
                                world_size=2)
    assert launched.parallel.virtual_pipeline_model_parallel_size == 2
    asked = estimate_layout(config, layout_of(config, 2), device="cpu")
    assert asked.layout.virtual_pipeline_model_parallel_size == 2
    assert asked.bubble_fraction == pytest.approx(1 / (2 * 8 + 1))  # (p - 1) / (v m + p - 1)
    one_f_one_b = parse_config(PP2, world_size=2)
    assert estimate_layout(one_f_one_b, layout_of(one_f_one_b, 2), device="cpu").bubble_fraction == \
        pytest.approx(1 / (8 + 1))
    layouts = candidate_layouts(config, 2)
    interleaved = [lay for lay in layouts if lay.virtual_pipeline_model_parallel_size == 2]
    assert interleaved and all(lay.pipeline_model_parallel_size == 2 for lay in interleaved)
    for lay in interleaved:  # each one is a config pretrain accepts, with its chunks
        candidate = config_with_layout(config, lay)
        validate(candidate, world_size=2)
        assert candidate.parallel.virtual_pipeline_model_parallel_size == 2
