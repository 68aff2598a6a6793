"""Checkpoints written by pipeline stages are the one-stage format: saved at 2 stages, resumed at 2 stages and at 1,
and saved at 1 stage, resumed at 2: each continues the uninterrupted run exactly.

The stages' weights are gathered into the whole model's files (the tied copy stored once, as the embeddings) and
their optimizer state is stored by the whole model's names, so a resume at any pipeline size reads the same
tensors. Tied embeddings, fp32, no dropout, clipping on.
"""

from __future__ import annotations

import pytest

from pipeline_runs import run_records

COMMON = ["--eval-iters", "0", "--eval-interval", "0", "--global-batch-size", "4", "--zero-stage", "0"]


def _losses(tmp_path, name, nproc, args):
    return {r["iteration"]: r["lm_loss"] for r in run_records(tmp_path, name, nproc, [*COMMON, *args])
            if "eval" not in r}


def test_checkpoints_resume_across_pipeline_sizes_both_ways(tmp_path):
    saved = tmp_path / "pp2"
    _losses(tmp_path, "first-half", 2, ["--train-iters", "4", "--exit-interval", "2", "--save", str(saved),
                                        "--pipeline-model-parallel-size", "2"])
    one_stage = tmp_path / "pp1"  # the uninterrupted run, saving at 2 for the resume at two stages below
    whole = _losses(tmp_path, "whole", 1, ["--train-iters", "4", "--save", str(one_stage), "--save-interval", "2"])
    for name, nproc, load, layout in (("resumed-pp2", 2, saved, ["--pipeline-model-parallel-size", "2"]),
                                      ("resumed-pp1", 1, saved, []),
                                      ("pp1-resumed-pp2", 2, one_stage / "iter_0000002",
                                       ["--pipeline-model-parallel-size", "2"])):
        resumed = _losses(tmp_path, name, nproc, ["--train-iters", "4", "--load", str(load), *layout])
        assert sorted(resumed) == [3, 4], name
        for iteration in (3, 4):
            assert resumed[iteration] == pytest.approx(whole[iteration], rel=1e-5), (name, iteration)
