"""Checkpoints written by pipeline stages are the one-stage format: saved at 2 stages, resumed at 2 stages and at 1,
both continue the uninterrupted run exactly.

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


def test_two_stage_checkpoint_resumes_at_two_stages_and_at_one(tmp_path):
    saved = tmp_path / "pp2"
    _losses(tmp_path, "first-half", 2, ["--train-iters", "4", "--exit-interval", "2", "--save", str(saved),
                                        "--pipeline-model-parallel-size", "2"])
    whole = _losses(tmp_path, "whole", 1, ["--train-iters", "4"])
    for name, nproc, layout in (("resumed-pp2", 2, ["--pipeline-model-parallel-size", "2"]), ("resumed-pp1", 1, [])):
        resumed = _losses(tmp_path, name, nproc, ["--train-iters", "4", "--load", str(saved), *layout])
        assert sorted(resumed) == [3, 4], name
        for iteration in (3, 4):
            assert resumed[iteration] == pytest.approx(whole[iteration], rel=1e-5), (name, iteration)
