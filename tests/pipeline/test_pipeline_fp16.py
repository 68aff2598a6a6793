"""fp16 pipeline stages train the model the unstaged fp16 run trains, with one loss scale on every stage, and an
overflow on one stage skips the step and lowers the scale on every stage.

The model of :data:`pipeline_runs.TIED_TINY` (tied embeddings, clipped every step) in fp16, 4 micro-batches per
step, an initial loss scale of 256 (2^32, the default, overflows this model's first steps): the last stage
multiplies each micro-batch's loss by the optimizer's device loss scale inside the schedule, the norm over every
stage is taken of the still-scaled gradients and divided by it, and the step unscales them and skips alike on
every stage (:mod:`domino.train.pipeline_step`). At ZeRO-1 the ZeRO step agrees the overflow over the stages
(:mod:`domino.optim.zero_step`); at ZeRO 0 (:mod:`domino.optim.mixed_precision`, fp32 main gradients) the norm,
non-finite on every stage when it is on one, poisons every stage's gradients and its fused AdamW skips. Compared
with the one-stage fp16 run (ZeRO 0, its default at one replica) within the bf16 tests' bounds
(:func:`test_pipeline_bf16._tracks`).

Measured here (loss, gradient norm at iterations 1-4; TIED_TINY fp16, scale 256): one stage (6.2492795, 1.095180),
(6.2522640, 0.727398), (6.2630272, 0.476313), (6.2577724, 0.445293); two stages 1F1B and interleaved alike
(6.2492795, 1.095183), (6.2522364, 0.727192), (6.2630363, 0.476327), (6.2577653, 0.445344). The control: the
same two stages in fp32 log 6.2492766 at iteration 1, so the comparison tells fp16 stages from fp32 ones. Those
figures are from a CPU with AVX-512 FP16; on one without (an AMD EPYC with AVX-512 BF16 only, 2026-12-04) the
one-stage fp16 run logs (6.2492766, 1.095178), (6.2522984, 0.727259), (6.2625690, 0.490127) and the fp32 stages
(6.2492766, 1.095122), (6.2522893, 0.727512), (6.2625031, 0.490362): within the bounds, so the fp16 checks
also require the loss scale fp16 keeps.

The runs are `pretrain` in gloo ranks with DeepSpeed's CPU fp16 gate and domino's device check opened, as
``tests/train/test_device_decided_steps.py`` does: DeepSpeed refuses fp16 on CPUs without AVX-512 FP16
(``accelerator/cpu_accelerator.py``, ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``), where torch still runs
the tiny fp16 matmuls, only slowly.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional

import pytest

from distributed_helpers import run_distributed
from pipeline_runs import TIED_TINY
from test_pipeline_bf16 import COMMON, PP2, TP2_DOMINO, _tracks, _train

FP16 = ["--fp16", "--initial-loss-scale", "256", *COMMON]

_RUNS: Dict[str, List[dict]] = {}


def _fp16_pretrain(rank, world_size, out_dir, args, poisoned_call: Optional[int] = None):
    """`pretrain` of TIED_TINY ARGS in fp16; with ``poisoned_call`` the last stage's final-norm gradient is infinite
    in that micro-batch (counted over the run). Returns this rank's loss scale after each step, and the sum of
    squares of its Adam first moments (DeepSpeed's or torch's) after each step."""
    import torch.distributed as dist
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from domino.config import parse_config
    from domino.runtime import state
    from domino.train import pipeline_step, runtime_start
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.pretrain import pretrain

    CPU_Accelerator.is_fp16_supported = lambda self: True  # module docstring: DeepSpeed's gate, not torch's
    runtime_start.check_this_device = lambda config: None
    config = parse_config([*TIED_TINY, *args, "--metrics-file", f"{out_dir}/metrics.jsonl"])
    mesh = runtime_start.initialize_runtime(config)
    recipe = GPTRecipe(config, mesh)
    calls, scales, moments = [], [], []

    def model_builder(config, mesh):
        model = recipe.model_builder(config, mesh)
        if poisoned_call is not None and state.get_pipeline_model_parallel_rank() == 1:
            def poison(grad):
                calls.append(1)
                return grad * float("inf") if len(calls) == poisoned_call else grad

            model.final_layernorm.weight.register_hook(poison)
        return model

    step = getattr(pipeline_step.PipelineStep, "__call__")

    def recording(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        scales.append(float(self.loss_scale))  # a test-only host read after the step
        adam = getattr(self.optimizer.inner, "optimizer", self.optimizer.inner)  # DeepSpeed ZeRO's wraps torch's
        moments.append(sum(float(s["exp_avg"].double().pow(2).sum()) for s in adam.state.values()))
        return out

    pipeline_step.PipelineStep.__call__ = recording
    pretrain(config, model_builder, recipe.dataset_builder, recipe.forward_step, recipe.padded_vocab_size,
             get_batch=recipe.batch, mesh=mesh)
    dist.barrier()
    return scales, moments


def fp16_records(tmp_path, name: str, nproc: int, args: List[str]) -> List[dict]:
    """The metrics records (evaluation's included) of `pretrain` of TIED_TINY ARGS in fp16 on ``nproc`` gloo ranks,
    written under ``tmp_path / name``."""
    out = tmp_path / name
    out.mkdir()
    run_distributed(_fp16_pretrain, nproc, str(out), args)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _records(tmp_path_factory, name: str, nproc: int, args: List[str]) -> List[dict]:
    """The training records of one fp16 run (each run once per test session)."""
    if name not in _RUNS:
        _RUNS[name] = [r for r in fp16_records(tmp_path_factory.mktemp(name), name, nproc, args) if "eval" not in r]
    return _RUNS[name]


def _tracks_in_fp16(reference: List[dict], records: List[dict]) -> None:
    """Raises AssertionError unless ``records`` track the fp16 ``reference`` (:func:`test_pipeline_bf16._tracks`)
    and kept its loss scale of 256 at every step."""
    _tracks(reference, records)
    assert [r.get("loss_scale") for r in records] == [r["loss_scale"] for r in reference] == [256.0] * 3, "scale"


ZERO_1, ZERO_0 = ["--zero-stage", "1"], ["--zero-stage", "0"]


def test_fp16_stages_at_one_replica_default_to_zero_0():
    from domino.config import parse_config
    from domino.config.validate import zero_stage_for

    assert zero_stage_for(parse_config([*TIED_TINY, *FP16, *PP2]), 1) == 0
    assert zero_stage_for(parse_config([*TIED_TINY, *FP16, *PP2]), 2) == 1


@pytest.mark.parametrize("name,nproc,layout", [
    ("fp16pp2", 2, [*PP2, *ZERO_1]),
    ("fp16interleaved", 2, [*PP2, *ZERO_1, "--num-layers-per-virtual-pipeline-stage", "1"]),
    ("fp16pp2dp2", 4, [*PP2, *ZERO_1]),
    # domino's fp32 masters and main gradients (domino.optim.mixed_precision) in place of DeepSpeed's ZeRO-1.
    ("fp16pp2zero0", 2, [*PP2, *ZERO_0]),
])
def test_fp16_stages_track_the_unstaged_fp16_run(tmp_path_factory, name, nproc, layout):
    reference = _records(tmp_path_factory, "fp16pp1", 1, FP16)
    records = _records(tmp_path_factory, name, nproc, [*FP16, *layout])
    if nproc == 4:
        # Two replicas each average their two micro-batches' losses, then the replicas' means are averaged: one
        # fp32 ulp (2^-21 at 6.25) from the one-rank mean of four; the fp32 control is 6 ulps off.
        first, ref_first = records[0]["lm_loss"], reference[0]["lm_loss"]
        assert abs(first - ref_first) <= 2.0 ** -21, "iteration 1 loss"
        records = [{**records[0], "lm_loss": ref_first}, *records[1:]]
    _tracks_in_fp16(reference, records)


def test_fp16_stages_with_tp2_domino_sequence_parallel_and_recompute_track_tp2(tmp_path_factory):
    reference = _records(tmp_path_factory, "fp16tp2", 2, [*FP16, *TP2_DOMINO])
    records = _records(tmp_path_factory, "fp16pp2tp2", 4, [
        *FP16, *PP2, *ZERO_1, *TP2_DOMINO, "--sequence-parallel", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    _tracks_in_fp16(reference, records)


def test_the_fp16_comparison_fails_for_fp32_stages(tmp_path_factory):
    """On CPUs with fp16 arithmetic the first loss already differs; on those without (module docstring) the
    fp32 stages come within the bounds and their missing loss scale tells them apart."""
    reference = _records(tmp_path_factory, "fp16pp1", 1, FP16)
    with pytest.raises(AssertionError, match="iteration 1|scale"):
        _tracks_in_fp16(reference, _train(tmp_path_factory, "fp32pp2", 2, [*COMMON, *PP2]))


@pytest.mark.parametrize("zero", [ZERO_1, ZERO_0], ids=["zero1", "zero0"])
def test_an_fp16_overflow_on_one_stage_skips_the_step_and_halves_the_scale_on_every_stage(tmp_path, zero):
    """Only the last stage's gradients overflow (micro-batch 2 of step 2); both stages skip step 2 (the checkpoint
    after it holds step 1's weights on both) and halve their scale (hysteresis 1), and step 3 trains again with
    the halved one. At ZeRO 0 each stage's optimizer sees only its own gradients: the first stage skips because
    the norm over both stages is infinite.

    Step 1 (norm about 1.1, clipped to 0.05) also shows the gradients unscaled exactly once: Adam's first moment
    after one step is (1 - beta1) x the clipped gradient, whose norm over both stages is 0.1 x 0.05 (the tied
    embedding's copy on each stage counted twice at most). Losses cannot show it, Adam's update being the same
    for the gradient times any constant but for its epsilon; a gradient still carrying the scale 256 (or divided
    by it twice) moves the moments' squares by 2^16."""
    import torch

    from domino.checkpoint import model_shards

    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"fp16": {"hysteresis": 1}}))
    args = [*FP16, *PP2, *zero, "--train-iters", "3", "--save", str(tmp_path), "--save-interval", "1",
            "--deepspeed-config", str(ds_config)]
    results = run_distributed(_fp16_pretrain, 2, str(tmp_path), args, 6)
    assert [scales for scales, _ in results] == [[256.0, 128.0, 128.0]] * 2
    first_moments = sum(moments[0] for _, moments in results) / (0.1 * 0.05) ** 2
    assert 1.0 - 1e-3 <= first_moments <= 2.0, first_moments
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_iterations"] for r in records if "eval" not in r] == [0, 1, 1]
    weights = [model_shards.load_full_state_dict(tmp_path / f"iter_{i:07d}") for i in (1, 2, 3)]
    for name in weights[0]:  # both stages' layers: the first stage skipped with the last
        assert torch.equal(weights[0][name], weights[1][name]), name
    assert not all(torch.equal(weights[1][n], weights[2][n]) for n in weights[1])
