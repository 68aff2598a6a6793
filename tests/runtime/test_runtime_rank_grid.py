"""The TP x CP x DP x PP grid in Megatron-LM's rank order (``tp-cp-ep-dp-pp``), checked against Megatron's own example.

The example is the docstring of ``initialize_model_parallel`` in NVIDIA/Megatron-LM
``megatron/core/parallel_state.py`` (commit 00caa53): 16 GPUs, tensor parallel 2, pipeline parallel 4.
"""

import pytest

from distributed_helpers import run_distributed
from domino.config import ConfigError
from domino.runtime import state
from domino.runtime.mesh import RankGrid


def test_megatron_docstring_example():
    grid = RankGrid.build(16, 2, 4)
    assert grid.dp == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert grid.tp == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid.pp == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    # Megatron's default_embedding_ranks: the first and the last stage of each pipeline.
    assert grid.embedding == [[0, 12], [1, 13], [2, 14], [3, 15]]


def test_one_stage_is_the_tp_by_dp_grid():
    grid = RankGrid.build(8, 2, 1)
    assert grid.tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.dp == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.pp == [[r] for r in range(8)] and grid.embedding == [[r] for r in range(8)]


def test_context_parallel_ranks_sit_between_tp_and_dp():
    """Megatron's order with CP: ``global = tp + cp * TP + dp * TP * CP + pp * TP * CP * DP`` (16 ranks, TP 2, CP 2,
    PP 2, so DP 2): a CP group is ranks TP apart, the weights' replicas (gradients, ZeRO) are DP x CP."""
    grid = RankGrid.build(16, 2, 2, 2)
    assert grid.tp == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert grid.cp == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert sorted(grid.dp) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert grid.dp_cp == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert grid.pp == [[r, r + 8] for r in range(8)]
    with pytest.raises(ConfigError, match="x --context-parallel-size 3"):
        RankGrid.build(8, 2, 1, 3)


def test_sizes_that_do_not_divide_the_world_are_refused():
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 3"):
        RankGrid.build(8, 2, 3)


def _stage_groups(rank, world_size):
    state.initialize_model_parallel(1, pipeline_model_parallel_size=world_size)
    return state.get_pipeline_model_parallel_rank(), state.get_embedding_group() is not None


def test_a_middle_stage_has_no_embedding_group():
    """Three stages: the first and the last sum the tied embeddings' gradient, the middle one holds no copy."""
    assert run_distributed(_stage_groups, 3) == [(0, True), (1, False), (2, True)]
