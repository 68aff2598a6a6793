"""`domino pretrain` with pipeline stages trains the model the one-stage run trains.

The model of :data:`pipeline_runs.TIED_TINY` (tied embeddings, clipped every step), so the logged gradient norm
(summed over the stages, the tied copy counted once) and the update it scales both enter the later losses. The
one-stage run at the same data-parallel size is the reference; 2 stages x 2 data-parallel replicas (4 processes)
under ZeRO stage 1 (DeepSpeed's optimizer over each stage, the gradients reduced after the schedule,
:mod:`domino.train.pipeline_step`)
must log the same loss and gradient norm at every iteration, and the same validation and test losses: 3 evaluation
micro-batches run as a step's 2 on the 1F1B stages' forward-only GPipe schedule, then 1, fewer than the stages.
(The schedule alone, with TP and Domino, is tests/pipeline/test_pipeline_equivalence.py's.)
"""

from __future__ import annotations

import pytest

from pipeline_runs import run_records

COMMON = ["--train-iters", "3", "--eval-iters", "3", "--eval-interval", "2", "--global-batch-size", "8"]


def _records(tmp_path, name, nproc, layout):
    return run_records(tmp_path, name, nproc, [*COMMON, *layout])


def _assert_same_training(reference, records):
    train, ref_train = ([r for r in rs if "eval" not in r] for rs in (records, reference))
    assert [r["iteration"] for r in train] == [1, 2, 3]
    for ref, got in zip(ref_train, train):
        assert got["grad_norm"] > 0.05  # clipped: the clip factor is part of every update
        assert got["lm_loss"] == pytest.approx(ref["lm_loss"], rel=1e-5), got["iteration"]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), got["iteration"]
    evals, ref_evals = ([(r["eval"], r["iteration"], r["lm_loss"]) for r in rs if "eval" in r]
                        for rs in (records, reference))
    assert [e[:2] for e in evals] == [("valid", 2), ("valid", 3), ("test", 3)] == [e[:2] for e in ref_evals]
    for (split, iteration, loss), (_, _, ref_loss) in zip(evals, ref_evals):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (split, iteration)


def test_two_stages_by_two_replicas_with_zero1_train_as_one(tmp_path):
    reference = _records(tmp_path, "pp1", 2, ["--zero-stage", "1"])
    records = _records(tmp_path, "pp2dp2", 4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"])
    _assert_same_training(reference, records)
