"""`domino estimate` knows context parallelism: a rank's activations are its seq / CP tokens', the FLOPs the
whole sequence's, and the layout search tries CP where the run allows it."""

from __future__ import annotations

import dataclasses

import pytest

from domino.config.estimate import candidate_layouts, describe, estimate_layout, layout_of
from domino.config.flags import parse_config

LONG = ["--preset", "gpt3-1.3b", "--seq-length", "32768", "--max-position-embeddings", "32768",
        "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16"]


def _at(config, tp, cp):
    layout = dataclasses.replace(layout_of(config, tp * cp), tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 data_parallel_size=1)
    return estimate_layout(config, layout, gpu_memory_gb=80, peak_tflops=989)


def test_activations_and_logits_split_over_cp_and_the_work_does_not():
    config = parse_config(LONG)
    one, two = _at(config, 8, 1), _at(config, 8, 2)
    assert two.activations == pytest.approx(one.activations / 2, rel=1e-6)
    assert two.logits == pytest.approx(one.logits / 2, rel=1e-6)
    assert (two.weights, two.optimizer) == (one.weights, one.optimizer)  # CP shards activations, not weights
    assert two.flops_per_token == one.flops_per_token
    assert two.step_time_s == pytest.approx(one.step_time_s / 2)  # twice the GPUs on the same tokens
    assert "TP 8 x CP 2 x DP 1" in describe(two)


def test_the_search_tries_cp_only_where_the_run_allows_it():
    allowed = {lay.context_parallel_size for lay in candidate_layouts(parse_config(LONG), 16)}
    assert allowed == {1, 2, 4, 8}
    with_dropout = parse_config([*LONG, "--attention-dropout", "0.1"])  # ring attention has no dropout
    assert {lay.context_parallel_size for lay in candidate_layouts(with_dropout, 16)} == {1}
