"""DeepSpeed's mixed-precision optimizer steps decided on the device equal DeepSpeed's own bit for bit at TP=2,
read nothing on the host, and with one data-parallel replica reduce no gradient over the one-rank group:

* bf16 ZeRO 1, ``BF16_Optimizer`` (``domino.optim.bf16_step``; deepspeed 0.19.8 ``runtime/bf16_optimizer.py``):
  clipped on every step, or never;
* bf16 ZeRO 2, fp32 ZeRO 1 and fp16 ZeRO 1, ``DeepSpeedZeroOptimizer`` (``domino.optim.zero_step``;
  ``runtime/zero/stage_1_and_2.py``), fp16 with the device loss scaler (``domino.optim.device_loss_scale``;
  ``runtime/fp16/loss_scaler.py``) through hysteresis, halving and growth.

Each run steps two engines per rank built from the same weights, ours and ``deepspeed.initialize``'s (DeepSpeed's
engine and optimizer classes, built otherwise as ``build_deepspeed_optimizer`` builds ours), on the
same batches, one of whose gradients is not finite (both must skip it); one launch runs them all. fp16 runs on
this CPU (torch computes half on CPUs) once DeepSpeed's CPU accelerator is told it may: it answers
``torch.ops.mkldnn._is_mkldnn_fp16_supported()`` (``accelerator/cpu_accelerator.py``), False on CPUs without
AVX-512 FP16, and ``engine._do_sanity_check`` refuses fp16 then. Tiny shapes: 16-bit matmuls are slow on CPUs.
"""

import json
from unittest import mock

import pytest
import torch

from distributed_helpers import run_distributed

VOCAB = 64
INF = float("inf")
#: (name, flags, gradient factor per step): non-finite factors overflow. fp16 with hysteresis 2 and window 2:
#: step 1 uses up the hysteresis, step 2 halves the scale, step 5 is the second clean step after it and doubles it.
RUNS = [
    ("bf16-zero1-clipped", ["--bf16", "--zero-stage", "1", "--clip-grad", "0.05"], [1.0, INF, 1.0]),
    ("bf16-zero1-unclipped", ["--bf16", "--zero-stage", "1", "--clip-grad", "100"], [1.0, INF, 1.0]),
    ("bf16-zero2", ["--bf16", "--zero-stage", "2", "--clip-grad", "0.05"], [1.0, INF, 1.0]),
    ("fp32-zero1", ["--zero-stage", "1", "--clip-grad", "0.05"], [1.0, INF, 1.0]),
    ("fp16-zero1", ["--fp16", "--zero-stage", "1", "--clip-grad", "0.05", "--initial-loss-scale", "256"],
     [1.0, INF, INF, 1.0, 1.0, 1.0]),
]
#: The step whose update doubles the fp16 scale: DeepSpeed unscales with the doubled scale there
#: (domino.optim.zero_step), so only that step's results differ, by the clip factor's 1e-6 term.
GROWTH_STEP = {"fp16-zero1": 5}


def _flags(flags, ds_config):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--max-position-embeddings", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "0.01", "--tensor-model-parallel-size",
            "2", "--vocab-size", str(VOCAB), "--mock-data", "--train-iters", "3", "--deepspeed-config", ds_config,
            *flags]


def _engine(config, ours):
    from domino.model import GPTModel
    from domino.runtime import state
    import deepspeed

    from domino.optim import deepspeed_engine
    from domino.optim.deepspeed_optimizer import build_deepspeed_optimizer

    mesh = state.current_mesh()
    torch.manual_seed(3)  # the same initial weights for both engines
    if ours:
        return build_deepspeed_optimizer(GPTModel(config.model, VOCAB, tp=mesh.tp), config, mesh).engine
    plain = lambda **kwargs: deepspeed.initialize(**kwargs)[0]  # noqa: E731  (DeepSpeed's own engine and classes)
    with mock.patch.object(deepspeed_engine, "initialize", plain):
        engine = build_deepspeed_optimizer(GPTModel(config.model, VOCAB, tp=mesh.tp), config, mesh).engine
    assert type(engine) is deepspeed.DeepSpeedEngine
    return engine


def _fp32_partitions(optimizer):
    return getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_groups_flat_partition


def _snapshot(engine):
    opt = engine.optimizer
    scaler = getattr(opt, "loss_scaler", None)
    return {"weights": [p.detach().clone() for p in engine.module.parameters()],
            "master": [p.detach().clone() for p in _fp32_partitions(opt)],
            "adam": {k: v.clone() for state in opt.optimizer.state.values() for k, v in state.items()},
            "norm": float(engine.get_global_grad_norm()),
            "scale": float(scaler.cur_scale) if scaler is not None else 1.0}


class _OneRankReductions:
    """Counts DeepSpeed collectives of more than one element over a group of one rank (gradient buckets)."""

    NAMES = ("all_reduce", "reduce", "reduce_scatter_tensor")

    def __enter__(self):
        from deepspeed import comm

        self.count, self.saved = 0, {name: getattr(comm, name) for name in self.NAMES}
        for name, original in self.saved.items():
            setattr(comm, name, self._wrap(original))
        return self

    def _wrap(self, original):
        def wrapper(tensor, *args, group=None, **kwargs):
            if tensor.numel() > 1 and torch.distributed.get_world_size(group) == 1:
                self.count += 1
            return original(tensor, *args, group=group, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        from deepspeed import comm

        for name, original in self.saved.items():
            setattr(comm, name, original)


def _run(flags, factors, ds_config):
    from domino.config import parse_config
    from domino.optim import bf16_step, zero_step
    from domino.train.host_syncs import HostSyncProbe

    config = parse_config(_flags(flags, ds_config))
    ours, theirs = _engine(config, True), _engine(config, False)
    g = torch.Generator().manual_seed(9)
    result = {"classes": (type(ours.optimizer).__name__, type(theirs.optimizer).__name__),
              "allreduce": ours.enable_backward_allreduce, "steps": [], "reads": [0, 0], "reductions": [0, 0]}
    for factor in factors:
        batch = torch.randint(0, VOCAB, (2, 9), generator=g)
        for index, engine in enumerate((ours, theirs)):
            with HostSyncProbe() as probe, _OneRankReductions() as one_rank:
                loss = engine(batch[:, :-1], labels=batch[:, 1:]).float().mean() * factor
                engine.backward(loss)
                engine.step()
            result["reads"][index] += probe.count()
            result["reductions"][index] += one_rank.count
        result["steps"].append({"ours": _snapshot(ours), "theirs": _snapshot(theirs),
                                "flag": float(bf16_step.skip_flag(ours) if bf16_step.skip_flag(ours) is not None
                                              else zero_step.skip_flag(ours)),
                                "deepspeed_skips": theirs.skipped_steps})
    return result


def _body(rank, world_size, ds_config):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from domino.config import parse_config
    from domino.train import runtime_start

    CPU_Accelerator.is_fp16_supported = lambda self: True  # module docstring: DeepSpeed's gate, not torch's
    runtime_start.check_this_device = lambda config: None
    runtime_start.initialize_runtime(parse_config(_flags(RUNS[0][1], ds_config)))
    return {name: _run(flags, factors, ds_config) for name, flags, factors in RUNS}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ds_config = tmp_path_factory.mktemp("ds") / "ds.json"
    ds_config.write_text(json.dumps({"fp16": {"hysteresis": 2, "loss_scale_window": 2}}))
    return run_distributed(_body, 2, str(ds_config))


def _check_equal_to_deepspeed(name, runs):
    factors = next(f for n, _, f in RUNS if n == name)
    overflowed = [factor != 1.0 for factor in factors]
    for run in runs:
        steps = run[name]["steps"]
        assert [s["flag"] for s in steps] == [float(o) for o in overflowed]  # ours: the device flag per step
        assert [s["deepspeed_skips"] for s in steps] == [sum(overflowed[:i + 1]) for i in range(len(steps))]
        for i, step in enumerate(steps):
            ours, theirs = step["ours"], step["theirs"]
            assert (ours["norm"], ours["scale"]) == (theirs["norm"], theirs["scale"]), i
            assert (ours["norm"] == INF) == overflowed[i]
            if i == GROWTH_STEP.get(name):
                for a, b in zip(ours["master"], theirs["master"]):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
                continue
            for a, b in zip(ours["weights"] + ours["master"], theirs["weights"] + theirs["master"]):
                assert torch.equal(a, b), i
            assert ours["adam"].keys() == theirs["adam"].keys() and ours["adam"]
            for key in ours["adam"]:
                assert torch.equal(ours["adam"][key], theirs["adam"][key]), (i, key)
        assert run[name]["reads"][0] == 0 < run[name]["reads"][1], run[name]["reads"]  # DeepSpeed's step reads
    return [step["ours"] for step in runs[0][name]["steps"]]


def test_bf16_zero1_step_equals_deepspeeds_clipped_or_not(results):
    for run in results:
        for name in ("bf16-zero1-clipped", "bf16-zero1-unclipped"):
            assert run[name]["classes"] == ("DeviceDecidedBF16Optimizer", "BF16_Optimizer")
            assert not run[name]["allreduce"]  # DP=1: no all-reduce of the fp32 buffers over a group of one
    clipped = _check_equal_to_deepspeed("bf16-zero1-clipped", results)
    unclipped = _check_equal_to_deepspeed("bf16-zero1-unclipped", results)
    assert clipped[0]["norm"] > 0.05 and unclipped[0]["norm"] < 100  # the two cases really differ


def test_bf16_zero2_step_equals_deepspeeds_without_one_rank_reductions(results):
    for run in results:
        assert run["bf16-zero2"]["classes"] == ("DeviceDecidedZeroOptimizer", "DeepSpeedZeroOptimizer")
        assert run["bf16-zero2"]["reductions"][0] == 0 < run["bf16-zero2"]["reductions"][1]
    steps = _check_equal_to_deepspeed("bf16-zero2", results)
    assert 0.05 < steps[0]["norm"] < INF  # clipped


def test_fp32_zero1_step_equals_deepspeeds(results):
    for run in results:
        assert run["fp32-zero1"]["classes"] == ("DeviceDecidedZeroOptimizer", "DeepSpeedZeroOptimizer")
        assert run["fp32-zero1"]["reductions"][0] == 0 < run["fp32-zero1"]["reductions"][1]
    _check_equal_to_deepspeed("fp32-zero1", results)


def test_fp16_zero1_loss_scaling_on_the_device_equals_deepspeeds(results):
    for run in results:
        assert run["fp16-zero1"]["classes"] == ("DeviceDecidedZeroOptimizer", "DeepSpeedZeroOptimizer")
        assert run["fp16-zero1"]["reductions"][0] == 0 < run["fp16-zero1"]["reductions"][1]
    steps = _check_equal_to_deepspeed("fp16-zero1", results)
    # 256: step 1 uses up the hysteresis, step 2 halves, step 5 (two clean steps later) doubles.
    assert [s["scale"] for s in steps] == [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]
