"""The bf16 ZeRO-1 step decided on the device (domino.train.bf16_step) equals DeepSpeed's own BF16_Optimizer
step bit for bit at TP=2: clipped, unclipped, and skipped on a non-finite gradient.

Two engines per rank from the same weights, one with DeepSpeed's class (deepspeed 0.19.8
``runtime/bf16_optimizer.py``) and one with ours, step on the same batches; after every step their bf16 weights,
fp32 master weights and Adam states must be equal. Tiny shapes: bf16 matmuls are slow on CPUs without bf16 units.
"""

import pytest
import torch

from distributed_helpers import run_distributed

VOCAB = 64


def _flags(clip):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
            "--max-position-embeddings", "8", "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16",
            "--zero-stage", "1", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "0.01",
            "--clip-grad", str(clip), "--tensor-model-parallel-size", "2", "--vocab-size", str(VOCAB),
            "--mock-data", "--train-iters", "3"]


def _engine(config, seed):
    from domino.model import GPTModel
    from domino.train import engine as engine_setup

    torch.manual_seed(seed)  # the same initial weights for both engines
    return engine_setup.build_engine(GPTModel(config.model, VOCAB), config)


def _snapshot(engine):
    opt = engine.optimizer
    adam = {k: v.clone() for state in opt.optimizer.state.values() for k, v in state.items()}
    return ([p.detach().clone() for p in engine.module.parameters()],
            [p.detach().clone() for p in opt.fp32_groups_flat_partition], adam, engine.get_global_grad_norm())


def _body(rank, world_size, clip):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from domino.config import parse_config
    from domino.train import bf16_step, engine as engine_setup

    config = parse_config(_flags(clip))
    engine_setup.initialize_runtime(config)
    ours, theirs = _engine(config, 3), _engine(config, 3)
    assert type(ours.optimizer).__name__ == "DeviceDecidedBF16Optimizer"
    assert not ours.enable_backward_allreduce  # DP=1: no all-reduce of the fp32 buffers over a group of one
    theirs.optimizer.__class__ = BF16_Optimizer  # DeepSpeed's own step, for the reference
    g = torch.Generator().manual_seed(9)
    batches = [torch.randint(0, VOCAB, (2, 9), generator=g) for _ in range(3)]
    factors = [1.0, float("inf"), 1.0]  # the second step's gradients are not finite: both must skip it
    snapshots, skips = [], []
    for batch, factor in zip(batches, factors):
        for engine in (ours, theirs):
            loss = engine(batch[:, :-1], labels=batch[:, 1:]).float().mean() * factor
            engine.backward(loss)
            engine.step()
        skips.append((float(bf16_step.skip_flag(ours)), theirs.skipped_steps))
        snapshots.append((_snapshot(ours), _snapshot(theirs)))
    return snapshots, skips


@pytest.mark.parametrize("clip", [0.05, 100.0])  # clipping scales every step / never scales
def test_device_decided_step_equals_deepspeeds_bit_for_bit(clip):
    for snapshots, skips in run_distributed(_body, 2, clip):
        assert skips == [(0.0, 0), (1.0, 1), (0.0, 1)]  # our flag per step; DeepSpeed's running count
        for step, (ours, theirs) in enumerate(snapshots):
            for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
                assert torch.equal(a, b), step
            assert ours[2].keys() == theirs[2].keys()
            for key in ours[2]:
                assert torch.equal(ours[2][key], theirs[2][key]), (step, key)
            if step != 1:
                assert float(ours[3]) == float(theirs[3]) > 0, step
            else:
                assert float(ours[3]) == float(theirs[3]) == float("inf")
        first = snapshots[0][0]
        norm = float(first[3])
        assert (norm > clip) == (clip < 1)  # the two cases really differ: clipped once, never clipped once
