"""Per-stage batches: the first pipeline stage reads tokens and positions, the last labels and the loss mask, a middle
stage nothing from the data loader (Megatron-LM's ``get_batch`` on pipeline ranks, d98e8a64 ``pretrain_gpt.py``),
and the run trains as the one-stage run does, sample for sample.

Four stages of :data:`pipeline_runs.TIED_TINY` (one layer each) in fp32 on 4 processes, ``pretrain`` in-process
with a ``get_batch`` that counts its calls and the fields it hands the schedule; the one-stage run is the
reference (losses, gradient norms, consumed samples and evaluation losses within float rounding, as
test_pipeline_training.py).
"""

from __future__ import annotations

import json

import pytest

from distributed_helpers import run_distributed
from pipeline_runs import TIED_TINY, run_records

COMMON = ["--train-iters", "3", "--eval-iters", "3", "--eval-interval", "2", "--global-batch-size", "8"]


def test_which_stages_read_batches():
    from domino.config import parse_config
    from domino.train.pipeline_step import stage_reads_batches

    plain = parse_config(["--preset", "tiny"])
    assert [stage_reads_batches(plain, first, last) for first, last in
            ((True, False), (False, False), (False, True))] == [True, False, True]
    for flag in ("--reset-position-ids", "--reset-attention-mask"):  # positions or masks follow the documents
        assert stage_reads_batches(parse_config(["--preset", "tiny", flag]), False, False)


def _four_stages(rank, world_size, metrics):
    from domino.config import parse_config
    from domino.runtime import state
    from domino.train import runtime_start
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.pretrain import pretrain

    config = parse_config([*TIED_TINY, *COMMON, "--pipeline-model-parallel-size", "4", "--metrics-file", metrics])
    mesh = runtime_start.initialize_runtime(config)
    recipe = GPTRecipe(config, mesh)
    calls = []

    def get_batch(data_iterator):
        calls.append(data_iterator is not None)
        return recipe.batch(data_iterator)

    pretrain(config, recipe.model_builder, recipe.dataset_builder, recipe.forward_step, recipe.padded_vocab_size,
             get_batch=get_batch, mesh=mesh)
    return state.get_pipeline_model_parallel_rank(), len(calls), all(calls)


def test_middle_stages_read_nothing_and_the_run_trains_as_one_stage(tmp_path):
    metrics = tmp_path / "pp4.jsonl"
    per_rank = run_distributed(_four_stages, 4, str(metrics))
    # 3 steps of 4 micro-batches, and 3 evaluations (valid at 2 and 3, test at 3) of 3 micro-batches each.
    assert per_rank == [(0, 21, True), (1, 0, True), (2, 0, True), (3, 21, True)]
    reference = run_records(tmp_path, "pp1", 1, COMMON)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r.get("eval"), r["iteration"], r.get("consumed_samples")) for r in records] == [
        (r.get("eval"), r["iteration"], r.get("consumed_samples")) for r in reference]
    for ref, got in zip(reference, records):
        assert got["lm_loss"] == pytest.approx(ref["lm_loss"], rel=1e-5), (got.get("eval"), got["iteration"])
        if "eval" not in ref:
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), got["iteration"]
