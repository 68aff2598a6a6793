"""ZeRO 0 in fp32 without DeepSpeed (domino.optim.torch_optimizer): the same weights, moments and norms as
DeepSpeed 0.19.8's engine around the same torch AdamW, step for step, at DP 2 with two micro-batches per step and
clipping active; the gradients live in contiguous buckets whose reduction the backward launches.

The reference is DeepSpeed's own ZeRO 0 path (``build_deepspeed_optimizer``: the engine divides the loss by the
accumulation steps, all-reduces the flattened gradients after the backward and scales by 1/DP, then domino clips
and torch's fused AdamW steps). Equal bit for bit: the same sums in the same order on two ranks.
"""

from __future__ import annotations

import pytest
import torch

from distributed_helpers import run_distributed

VOCAB = 64
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
         "--max-position-embeddings", "8", "--vocab-size", str(VOCAB), "--mock-data", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--lr", "0.01", "--clip-grad", "0.05", "--zero-stage", "0", "--train-iters", "3",
         "--hidden-dropout", "0", "--attention-dropout", "0"]  # no RNG: the two runs draw nothing


def _state(optimizer):
    inner = optimizer.inner
    return {"weights": [p.detach().clone() for p in optimizer.module.parameters()],
            "adam": [{k: v.clone() for k, v in inner.state[p].items()} for p in optimizer.module.parameters()]}


def _steps(optimizer, batches, launched):
    out = []
    for step_batches in batches:
        for last, batch in zip(optimizer.micro_batches(len(step_batches) * 2, 2), step_batches):
            loss = optimizer.forward_model(batch[:, :-1], labels=batch[:, 1:]).float().mean()
            optimizer.backward(loss)
            if last and launched is not None:  # the buckets' reductions, launched by the backward itself
                launched.append(sum(h is not None for h in optimizer.grads._handles))
        outcome = optimizer.step()
        out.append({"norm": float(outcome.grad_norm), "skipped": float(outcome.skipped), **_state(optimizer)})
    return out


def _body(rank, world_size):
    from domino.config import parse_config
    from domino.model import GPTModel
    from domino.optim.build import build_optimizer
    from domino.optim.deepspeed_optimizer import build_deepspeed_optimizer
    from domino.optim.grad_buffer import GradBuckets
    from domino.optim.torch_optimizer import TorchAdamW
    from domino.train import runtime_start

    config = parse_config(FLAGS, world_size=world_size)
    mesh = runtime_start.initialize_runtime(config)
    g = torch.Generator().manual_seed(5 + rank)  # each replica its own data
    batches = [[torch.randint(0, VOCAB, (1, 9), generator=g) for _ in range(2)] for _ in range(3)]
    torch.manual_seed(3)
    ours = build_optimizer(GPTModel(config.model, VOCAB, tp=mesh.tp), config, mesh)
    torch.manual_seed(3)
    theirs = build_deepspeed_optimizer(GPTModel(config.model, VOCAB, tp=mesh.tp), config, mesh)
    views = all(p.grad is not None and any(p.grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                                           for b in ours.grads.buffers) for p in ours.module.parameters())
    small = GradBuckets(list(GPTModel(config.model, VOCAB, tp=mesh.tp).parameters()), mesh.dp, mesh.dp_cp,
                        bucket_elements=1000)
    launched = []
    return {"class": type(ours).__name__, "is_torch": isinstance(ours, TorchAdamW), "views": views,
            "buckets": len(small.buckets), "ours": _steps(ours, batches, launched),
            "theirs": _steps(theirs, batches, None), "launched": launched, "bucket_count": len(ours.grads.buckets)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, 2)


def test_zero_0_fp32_is_torch_adamw_with_gradients_as_bucket_views(results):
    for r in results:
        assert r["class"] == "TorchAdamW" and r["is_torch"]
        assert r["views"]  # every .grad is a view into a bucket: reduced in place, no flatten or copy
        assert r["buckets"] > 1  # a small bucket size cuts several


def test_the_backward_launches_every_buckets_reduction(results):
    for r in results:
        assert r["launched"] == [r["bucket_count"]] * 3


def test_steps_equal_deepspeeds_zero_0_bit_for_bit(results):
    for r in results:
        for i, (ours, theirs) in enumerate(zip(r["ours"], r["theirs"])):
            assert ours["norm"] == theirs["norm"] and ours["norm"] > 0.05, i  # clipped: the norm is over the limit
            assert ours["skipped"] == 0.0
            for a, b in zip(ours["weights"], theirs["weights"]):
                assert torch.equal(a, b), i
            for a, b in zip(ours["adam"], theirs["adam"]):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), i
    # the replicas agree: their mean gradient is one
    for a, b in zip(results[0]["ours"][-1]["weights"], results[1]["ours"][-1]["weights"]):
        assert torch.equal(a, b)


def test_a_zero_0_fp32_run_saves_and_resumes_with_deepspeed_not_importable(tmp_path):
    """Nothing of a ZeRO 0 fp32 run needs DeepSpeed: with every ``import deepspeed`` made to fail, ``domino
    pretrain`` trains, saves its optimizer state by name and resumes from it (the start-up no longer pays
    DeepSpeed's import, issue 52's restart cost)."""
    import subprocess
    import sys

    from train.train_helpers import TINY, child_env

    code = ("import sys; sys.modules['deepspeed'] = None\n"  # any import of DeepSpeed raises ImportError
            "from domino.cli.main import main; main(sys.argv[1:])")
    save = str(tmp_path / "ckpt")
    for stop in (["--exit-interval", "2"], []):  # two iterations, then the third resumed
        proc = subprocess.run([sys.executable, "-c", code, "pretrain", *TINY, "--mock-data", "--train-iters", "3",
                               "--save", save, "--load", save, "--save-interval", "1", *stop],
                              env=child_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
