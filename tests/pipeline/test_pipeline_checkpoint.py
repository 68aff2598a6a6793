"""Checkpoints written by pipeline stages resume on any layout: saved at 2 stages of 2 interleaved chunks each,
resumed at 2 stages (1F1B), at 1 stage of TP 2 and at 1 stage of DP 2 (ZeRO 1), and saved at 1 stage, resumed at 2
stages of 2 chunks: each continues the uninterrupted run exactly, and the interleaved run's own first iterations and
its validation and test losses (3 evaluation micro-batches: a step's 2, then 1) are the one-stage run's.

Each stage writes the weights it holds into a file of its own (nothing is gathered onto one host; the interleaved
run saves in the background, ``--async-save``, at ZeRO 1: each rank's own optimizer fragments), by the whole
model's names (the tied copy stored once, as the embeddings), and the optimizer state by the same names, so a
resume at any pipeline size reads the tensors its stages hold from whichever files hold them; with chunks a rank's
layers are not consecutive (rank 0 holds layers 0 and 2 of 4), and the names say which. Tied embeddings, fp32, no
dropout, clipping on.
"""

from __future__ import annotations

import pytest

from pipeline_runs import run_logged

from domino.checkpoint.model_shards import read_header_shapes
from domino.checkpoint.on_disk import Checkpoint

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
                                                     str(saved), "--async-save", "--zero-stage", "1", *interleaved],
                         log_has="interleaved 1F1B over 4 virtual stages, virtual stages 0, 2 (layers 0; 2)")
    one_stage = tmp_path / "pp1"  # the uninterrupted run, saving at 2 for the resume at two stages below
    whole_evals, interleaved_evals = {}, {}
    whole = _losses(tmp_path, "whole", 1, ["--train-iters", "4", "--save", str(one_stage), "--save-interval", "2",
                                           *EVAL], evals=whole_evals)
    assert sorted(first_half) == [1, 2]
    files = {path.name: set(read_header_shapes(path)) for path in (saved / "iter_0000002" / "model").iterdir()}
    assert sorted(files) == ["tp_rank_00_pp_rank_000.safetensors", "tp_rank_00_pp_rank_001.safetensors"]
    assert {n.split(".")[1] for n in files["tp_rank_00_pp_rank_000.safetensors"] if n.startswith("layers.")} == {
        "0", "2"}, "stage 0's file holds the layers of its two chunks"
    assert not any(n.startswith("embedding.") for n in files["tp_rank_00_pp_rank_001.safetensors"]), "tied copy"
    assert Checkpoint.read(saved / "iter_0000002").meta["optimizer"]["storage"] == "fragments"
    for iteration in (1, 2):
        assert first_half[iteration] == pytest.approx(whole[iteration], rel=1e-5), ("interleaved", iteration)
    for name, nproc, load, layout in (("resumed-pp2", 2, saved, ["--pipeline-model-parallel-size", "2",
                                                                  "--zero-stage", "1"]),
                                      ("resumed-pp1-tp2", 2, saved, ["--tensor-model-parallel-size", "2"]),
                                      ("resumed-pp1-dp2", 2, saved, ["--zero-stage", "1"]),
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
