"""ZeRO 0 with 16-bit weights without DeepSpeed (domino.optim.mixed_precision): fp32 master weights, fp32 main
gradients in the data-parallel buckets, torch's fused AdamW, at DP 2 with two micro-batches per step, clipping on.

* bf16 equals DeepSpeed 0.19.8's ``BF16_Optimizer`` (bf16 ZeRO 1, domino's device-decided step) bit for bit, step
  for step: the same fp32 sums of the same bf16 micro-batch gradients (``_update_hp_grad``), the same fp32
  all-reduce divided by DP after the sum (``allreduce_bucket``), the norm's squares summed in the same (optimizer
  group) order, the clip factor, elementwise AdamW on fp32 masters (a DP partition of a flat buffer there, a view
  per parameter here: elementwise, the same numbers) and the same rounding into bf16.
* fp16 skips an overflowing step and moves its loss scale as DeepSpeed's ZeRO 1 fp16 does (hysteresis 2, window 2:
  the scale sequence is compared step for step), without a host read. Its weights are close, not equal: DeepSpeed's
  ZeRO 1 sums fp16 gradients over the micro-batches in fp16 and reduces them in fp16, these in fp32.
"""

from __future__ import annotations

import json

import pytest
import torch

from distributed_helpers import run_distributed

VOCAB = 64
INF = float("inf")
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
         "--max-position-embeddings", "8", "--vocab-size", str(VOCAB), "--mock-data", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--lr", "0.01", "--clip-grad", "0.05", "--train-iters", "3",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
#: Loss factors per step of the fp16 runs: two overflows (hysteresis 2: the first uses it up, the second halves
#: the scale), then clean steps (the second clean one after the overflow doubles it, window 2).
FP16_FACTORS = [1.0, INF, INF, 1.0, 1.0, 1.0]


def _steps(optimizer, batches, factors, probe_grads=False):
    from domino.optim import state
    from domino.train.host_syncs import HostSyncProbe

    out = []
    for step_batches, factor in zip(batches, factors):
        reads = 0
        for last, batch in zip(optimizer.micro_batches(len(step_batches) * 2, 2), step_batches):
            loss = optimizer.forward_model(batch[:, :-1], labels=batch[:, 1:]).float().mean() * factor
            with HostSyncProbe() as probe:  # the backward's hooks (the forward's loss reads are not ours)
                optimizer.backward(loss)
            reads += probe.count()
        freed = all(p.grad is None for p in optimizer.module.parameters()) if probe_grads else None
        with HostSyncProbe() as probe:
            outcome = optimizer.step()
        tensors, scalars = state.gather(optimizer)
        out.append({"norm": float(outcome.grad_norm), "skipped": float(outcome.skipped), "reads": reads + probe.count(),
                    "freed": freed, "scale": optimizer.loss_scale(), "state": tensors, "step": scalars.step,
                    "weights": [p.detach().clone() for p in optimizer.module.parameters()]})
    return out


def _pair(flags, ours_stage, batches, factors):
    from domino.config import parse_config
    from domino.model import GPTModel
    from domino.optim.build import build_optimizer
    from domino.optim.deepspeed_optimizer import build_deepspeed_optimizer
    from domino.runtime import state

    mesh = state.current_mesh()
    ours_config = parse_config([*FLAGS, *flags, "--zero-stage", ours_stage], world_size=2)
    torch.manual_seed(3)
    ours = build_optimizer(GPTModel(ours_config.model, VOCAB, tp=mesh.tp), ours_config, mesh)
    theirs_config = parse_config([*FLAGS, *flags, "--zero-stage", "1"], world_size=2)
    torch.manual_seed(3)
    theirs = build_deepspeed_optimizer(GPTModel(theirs_config.model, VOCAB, tp=mesh.tp), theirs_config, mesh)
    views = all(any(p.main_grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                    for b in ours.grads.buffers) for p in ours.module.parameters())
    result = {"class": type(ours).__name__, "views": views,
              "dtypes": sorted({str(p.dtype) for p in ours.module.parameters()}),
              "ours": _steps(ours, batches, factors, probe_grads=True), "theirs": _steps(theirs, batches, factors)}
    ours.destroy()
    theirs.destroy()
    return result


def _body(rank, world_size, ds_config):
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from domino.config import parse_config
    from domino.train import runtime_start

    CPU_Accelerator.is_fp16_supported = lambda self: True  # DeepSpeed's gate (test_device_decided_steps), not torch's
    runtime_start.initialize_runtime(parse_config(FLAGS, world_size=world_size))
    g = torch.Generator().manual_seed(5 + rank)  # each replica its own data
    batches = [[torch.randint(0, VOCAB, (1, 9), generator=g) for _ in range(2)] for _ in range(len(FP16_FACTORS))]
    fp16 = ["--fp16", "--initial-loss-scale", "256", "--deepspeed-config", ds_config]
    return {"bf16": _pair(["--bf16"], "0", batches[:3], [1.0] * 3),
            "fp16": _pair(fp16, "0", batches, FP16_FACTORS)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ds_config = tmp_path_factory.mktemp("ds") / "ds.json"
    ds_config.write_text(json.dumps({"fp16": {"hysteresis": 2, "loss_scale_window": 2}}))
    return run_distributed(_body, 2, str(ds_config))


def test_bf16_zero_0_is_domino_with_fp32_main_gradients_in_the_buckets(results):
    for r in results:
        run = r["bf16"]
        assert run["class"] == "MixedPrecisionAdamW" and run["dtypes"] == ["torch.bfloat16"]
        assert run["views"]  # every main_grad is a view into a bucket: reduced in place
        assert all(step["freed"] for step in run["ours"])  # the bf16 .grad freed once added in fp32
        assert all(step["reads"] == 0 for step in run["ours"])  # no host read in the step


def test_bf16_steps_equal_deepspeeds_bf16_optimizer_bit_for_bit(results):
    for r in results:
        for i, (ours, theirs) in enumerate(zip(r["bf16"]["ours"], r["bf16"]["theirs"])):
            assert ours["norm"] == theirs["norm"] and ours["norm"] > 0.05, i  # clipped: the norm is over the limit
            assert ours["skipped"] == 0.0 and ours["step"] == theirs["step"] == i + 1
            for a, b in zip(ours["weights"], theirs["weights"]):
                assert a.dtype == torch.bfloat16 and torch.equal(a, b), i
            assert ours["state"].keys() == theirs["state"].keys()
            for name, value in ours["state"].items():
                assert torch.equal(value, theirs["state"][name]), (i, name)
    masters = [t for name, t in results[0]["bf16"]["ours"][-1]["state"].items() if name.startswith("fp32.")]
    assert any(not torch.equal(t, t.bfloat16().float()) for t in masters)  # fp32 masters, off bf16's grid
    for a, b in zip(results[0]["bf16"]["ours"][-1]["weights"], results[1]["bf16"]["ours"][-1]["weights"]):
        assert torch.equal(a, b)  # the replicas agree


def test_fp16_skips_overflows_and_scales_the_loss_as_deepspeeds_zero(results):
    overflowed = [float(f != 1.0) for f in FP16_FACTORS]
    for r in results:
        ours, theirs = r["fp16"]["ours"], r["fp16"]["theirs"]
        assert r["fp16"]["class"] == "MixedPrecisionAdamW" and r["fp16"]["dtypes"] == ["torch.float16"]
        assert [s["skipped"] for s in ours] == [s["skipped"] for s in theirs] == overflowed
        assert [s["scale"] for s in ours] == [s["scale"] for s in theirs] == [256, 256, 128, 128, 128, 256]
        assert [s["step"] for s in ours] == [s["step"] for s in theirs] == [1, 1, 1, 2, 3, 4]
        assert all(s["reads"] == 0 for s in ours)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if overflowed[i]:
                assert all(torch.equal(x, y) for x, y in zip(a["weights"], ours[i - 1]["weights"])), i  # skipped
                assert a["norm"] != a["norm"] or a["norm"] == INF
                continue
            # DeepSpeed's ZeRO 1 sums the fp16 gradients in fp16 (micro-batches and the DP all-reduce): close.
            assert a["norm"] == pytest.approx(b["norm"], rel=2e-3), i
            masters = [(value, b["state"][name]) for name, value in a["state"].items() if name.startswith("fp32.")]
            mean_gap = sum((x - y).abs().sum() for x, y in masters) / sum(x.numel() for x, _ in masters)
            # Measured: at most 3.3e-5 (DeepSpeed's fp16 sums round small gradients, which Adam's normalised
            # update turns into whole steps of the learning rate, 0.01, on a few elements); bound 1e-4.
            assert mean_gap < 1e-4, (i, float(mean_gap))


def test_bf16_resumes_across_deepspeeds_zero_1_and_domino_zero_0_without_deepspeed(tmp_path):
    """The state by name is layout-free: a bf16 ZeRO 1 checkpoint (DeepSpeed's BF16_Optimizer) resumes at ZeRO 0
    (given: a resume keeps the checkpoint's stage otherwise) in a process where every ``import deepspeed`` fails, whose own checkpoint resumes at ZeRO 1 again; both legs
    log the uninterrupted ZeRO 1 run's losses and gradient norms exactly (at one replica the two optimizers do the
    same arithmetic: no all-reduce, the norm's squares summed in the same order)."""
    import subprocess
    import sys

    from train.train_helpers import TINY, child_env, read_metrics, run_pretrain

    flags = [*TINY, "--mock-data", "--vocab-size", "256", "--bf16", "--train-iters", "6", "--eval-iters", "0",
             "--eval-interval", "0", "--global-batch-size", "8", "--clip-grad", "0.05",
             "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--save-interval", "2"]

    def records(path):
        return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in read_metrics(path) if "eval" not in r}

    first, second = tmp_path / "zero1", tmp_path / "zero0"
    run_pretrain([*flags, "--zero-stage", "1", "--save", str(first), "--metrics-file", str(tmp_path / "a.jsonl")])
    code = ("import sys; sys.modules['deepspeed'] = None\n"  # any import of DeepSpeed raises ImportError
            "from domino.cli.main import main; main(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, "pretrain", *flags, "--zero-stage", "0",
                           "--load", str(first / "iter_0000002"),
                           "--save", str(second), "--exit-interval", "4", "--metrics-file", str(tmp_path / "b.jsonl")],
                          env=child_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    run_pretrain([*flags, "--zero-stage", "1", "--load", str(second / "iter_0000004"),
                  "--metrics-file", str(tmp_path / "c.jsonl")])
    reference = records(tmp_path / "a.jsonl")
    assert sorted(reference) == list(range(1, 7))
    assert records(tmp_path / "b.jsonl") == {i: reference[i] for i in (3, 4)}
    assert records(tmp_path / "c.jsonl") == {i: reference[i] for i in (5, 6)}
