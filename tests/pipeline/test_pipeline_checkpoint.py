"""Checkpoints written by pipeline stages are the one-stage format: saved at 2 stages of 2 interleaved chunks each,
resumed at 2 stages (1F1B) and at 1, and saved at 1 stage, resumed at 2 stages of 2 chunks: each continues the
uninterrupted run exactly, and the interleaved run's own first iterations and its validation and test losses
(3 evaluation micro-batches: a step's 2, then 1) are the one-stage run's.

The stages' weights are gathered into the whole model's files (the tied copy stored once, as the embeddings) and
their optimizer state is stored by the whole model's names, so a resume at any pipeline size reads the same
tensors; with chunks a rank's layers are not consecutive (rank 0 holds layers 0 and 2 of 4), and the names say
which. Tied embeddings, fp32, no dropout, clipping on.
"""

from __future__ import annotations

import pytest

from pipeline_runs import run_logged

COMMON = ["--eval-iters", "0", "--eval-interval", "0", "--global-batch-size", "4", "--zero-stage", "0"]


#: Validation at iteration 4 and the final test, 3 micro-batches each: a step's 2, then 1 (fewer than the stages).
EVAL = ["--eval-iters", "3", "--eval-interval", "4"]


def _losses(tmp_path, name, nproc, args, log_has=None, evals=None):
    records, log = run_logged(tmp_path, name, nproc, [*COMMON, *args])
    if log_has is not None:  # what rank 0 says it runs
        assert log_has in log, name
    if evals is not None:
        evals.update({(r["eval"], r["iteration"]): r["lm_loss"] for r in records if "eval" in r})
    return {r["iteration"]: r["lm_loss"] for r in records if "eval" not in r}


def test_checkpoints_resume_across_pipeline_sizes_both_ways(tmp_path):
    saved = tmp_path / "pp2-interleaved"
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    first_half = _losses(tmp_path, "first-half", 2, ["--train-iters", "4", "--exit-interval", "2", "--save",
                                                     str(saved), *interleaved],
                         log_has="interleaved 1F1B over 4 virtual stages, virtual stages 0, 2 (layers 0; 2)")
    one_stage = tmp_path / "pp1"  # the uninterrupted run, saving at 2 for the resume at two stages below
    whole_evals, interleaved_evals = {}, {}
    whole = _losses(tmp_path, "whole", 1, ["--train-iters", "4", "--save", str(one_stage), "--save-interval", "2",
                                           *EVAL], evals=whole_evals)
    assert sorted(first_half) == [1, 2]
    for iteration in (1, 2):
        assert first_half[iteration] == pytest.approx(whole[iteration], rel=1e-5), ("interleaved", iteration)
    for name, nproc, load, layout in (("resumed-pp2", 2, saved, ["--pipeline-model-parallel-size", "2"]),
                                      ("resumed-pp1", 1, saved, []),
                                      ("pp1-resumed-pp2-interleaved", 2, one_stage / "iter_0000002", interleaved)):
        chunks = layout == interleaved  # also evaluated on the chunks' forward-only schedule
        resumed = _losses(tmp_path, name, nproc, ["--train-iters", "4", "--load", str(load), *layout,
                                                  *(EVAL if chunks else [])],
                          log_has="virtual stages 0, 2 (layers 0; 2)" if chunks else None,
                          evals=interleaved_evals if chunks else None)
        assert sorted(resumed) == [3, 4], name
        for iteration in (3, 4):
            assert resumed[iteration] == pytest.approx(whole[iteration], rel=1e-5), (name, iteration)
    assert sorted(interleaved_evals) == sorted(whole_evals) == [("test", 4), ("valid", 4)]
    for key, loss in interleaved_evals.items():
        assert loss == pytest.approx(whole_evals[key], rel=1e-5), key
