"""bf16 pipeline stages train the model the unstaged bf16 run trains, and a non-finite gradient on one stage skips
the step on every stage.

The model of :data:`pipeline_runs.TIED_TINY` (tied embeddings, clipped every step) in bf16, 4 micro-batches per
step: DeepSpeed's BF16_Optimizer accumulates each micro-batch's bf16 gradient in its fp32 buffers through its
per-gradient hooks during the pipeline schedule's backward (:mod:`domino.train.pipeline_step`). Each staged run
is compared with the one-stage run at the same tensor-parallel layout:

* iteration 1's loss is the same number (the forward of the same bf16 weights, cut into stages: the same
  arithmetic), and its gradient norm within 1e-4 (the fp32 sums of the stages' squares, the micro-batches and the
  replicas are added in another order; sequence parallelism reduce-scatters where the reference all-reduces);
* later losses within 1e-4 and gradient norms within 2e-3 (bf16 weights after AdamW steps of slightly different
  fp32 gradients round to neighbouring bf16 numbers).

Measured here (loss, gradient norm at iterations 1-3; TIED_TINY, 3 steps): one stage (6.2493849, 1.096078),
(6.2523031, 0.724120), (6.2625017, 0.490395); 2 stages 1F1B (6.2493849, 1.096081), (6.2523689, 0.724494),
(6.2625184, 0.490265). The control: the same two stages in fp32 log (6.2492766, 1.095122) at iteration 1, outside
both bounds, so the comparison tells bf16 stages from fp32 ones.
"""

from __future__ import annotations

from typing import Dict, List

import pytest

from distributed_helpers import run_distributed
from pipeline_runs import TIED_TINY, run_records

COMMON = ["--train-iters", "3", "--eval-iters", "0", "--eval-interval", "0", "--global-batch-size", "8"]
BF16 = ["--bf16", *COMMON]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2_DOMINO = ["--tensor-model-parallel-size", "2", "--domino-chunks", "2"]
#: Relative bounds: iteration 1's gradient norm; later losses; later gradient norms.
REL_FIRST_NORM, REL_LOSS, REL_NORM = 1e-4, 1e-4, 2e-3

_CACHE: Dict[str, List[dict]] = {}


def _train(tmp_path_factory, name: str, nproc: int, args: List[str]) -> List[dict]:
    """The training records of one run (each run once per test session)."""
    if name not in _CACHE:
        _CACHE[name] = [r for r in run_records(tmp_path_factory.mktemp(name), name, nproc, args) if "eval" not in r]
    return _CACHE[name]


def _tracks(reference: List[dict], records: List[dict]) -> None:
    """Raises AssertionError unless ``records`` track ``reference`` within the bf16 bounds of the module."""
    assert [r["iteration"] for r in records] == [r["iteration"] for r in reference] == [1, 2, 3]
    first, ref_first = records[0], reference[0]
    assert first["lm_loss"] == ref_first["lm_loss"], "iteration 1 loss"
    assert first["grad_norm"] == pytest.approx(ref_first["grad_norm"], rel=REL_FIRST_NORM), "iteration 1 norm"
    for ref, got in zip(reference[1:], records[1:]):
        assert got["grad_norm"] > 0.05  # clipped: the norm over every stage scales every update
        assert got["lm_loss"] == pytest.approx(ref["lm_loss"], rel=REL_LOSS), got["iteration"]
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL_NORM), got["iteration"]
        assert got["skipped_iterations"] == 0


@pytest.mark.parametrize("name,nproc,layout", [
    ("pp2", 2, PP2),
    ("interleaved", 2, [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
    # ZeRO-1 over 2 replicas: the fp32 buffers are averaged once, then BF16_Optimizer steps its partition.
    ("pp2dp2", 4, [*PP2, "--zero-stage", "1"]),
])
def test_bf16_stages_track_the_unstaged_bf16_run(tmp_path_factory, name, nproc, layout):
    reference = _train(tmp_path_factory, "pp1", 1, BF16)
    _tracks(reference, _train(tmp_path_factory, name, nproc, [*BF16, *layout]))


def test_bf16_stages_with_tp2_domino_sequence_parallel_and_recompute_track_tp2(tmp_path_factory):
    reference = _train(tmp_path_factory, "tp2", 2, [*BF16, *TP2_DOMINO])
    records = _train(tmp_path_factory, "pp2tp2", 4, [
        *BF16, *PP2, *TP2_DOMINO, "--sequence-parallel", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    _tracks(reference, records)


def test_the_comparison_fails_for_fp32_stages(tmp_path_factory):
    """The control: two fp32 stages (exact to the fp32 one-stage run, test_pipeline_training.py) do not pass as
    the bf16 run."""
    reference = _train(tmp_path_factory, "pp1", 1, BF16)
    with pytest.raises(AssertionError, match="iteration 1"):
        _tracks(reference, _train(tmp_path_factory, "fp32pp2", 2, [*COMMON, *PP2]))


def _overflow_on_the_last_stage(rank, world_size, out_dir, poisoned_call):
    """`pretrain` of two bf16 stages whose last stage's final-norm gradient is infinite in one micro-batch."""
    import torch

    from domino.config import parse_config
    from domino.runtime import state
    from domino.train import runtime_start
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.pretrain import pretrain

    config = parse_config([*TIED_TINY, *BF16, *PP2, "--train-iters", "3", "--save", out_dir, "--save-interval", "1",
                           "--metrics-file", f"{out_dir}/metrics.jsonl"])
    mesh = runtime_start.initialize_runtime(config)
    recipe = GPTRecipe(config, mesh)
    calls = []

    def model_builder(config, mesh):
        model = recipe.model_builder(config, mesh)
        if state.get_pipeline_model_parallel_rank() == 1:
            def poison(grad):  # runs before autograd accumulates the gradient, hence before DeepSpeed's hook
                calls.append(1)
                return grad * float("inf") if len(calls) == poisoned_call else grad

            model.final_layernorm.weight.register_hook(poison)
        return model

    pretrain(config, model_builder, recipe.dataset_builder, recipe.forward_step, recipe.padded_vocab_size,
             get_batch=recipe.batch, mesh=mesh)
    return len(calls)


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage(tmp_path):
    """The first stage's gradients stay finite; the norm over both stages does not, and every gradient is made NaN
    so each stage's BF16_Optimizer skips (found_inf on the device): the checkpoint after the skipped step holds the
    weights of the one before, on both stages; the next step trains again."""
    import json

    import torch

    from domino.checkpoint import model_shards

    calls = run_distributed(_overflow_on_the_last_stage, 2, str(tmp_path), 6)  # micro-batch 2 of step 2
    assert calls[1] == 12
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_iterations"] for r in records if "eval" not in r] == [0, 1, 1]
    weights = [model_shards.load_full_state_dict(tmp_path / f"iter_{i:07d}") for i in (1, 2, 3)]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:  # both stages' layers: the first stage skipped with the last
        assert torch.equal(weights[0][name], weights[1][name]), name
    assert not all(torch.equal(weights[1][n], weights[2][n]) for n in weights[1])
