"""Pipeline stages reach one outcome: the device-decided ZeRO step skips on every stage when one stage's
gradients are not finite, and a checkpoint snapshot failing on one stage fails on every stage at once.

DeepSpeed 0.19.8's ZeRO optimizer reduces its norm and overflow over the data-parallel group and its ``mpu``'s
model-parallel group (``_model_parallel_all_reduce``, ``runtime/zero/stage_1_and_2.py``), which is domino's
tensor-parallel group: alone, a stage with finite gradients would step while the stage with an overflow skips,
and their weights and Adam step counts would part for the rest of the run (``domino.optim.zero_step``). A
snapshot's host copy that fails on one rank (pinned host memory exhausted) must not leave the collectives after it
(the first stage gathering the whole model) waiting for that rank (``domino.checkpoint.checkpointing``).

One launch of two real gloo ranks, one per stage, each holding a stage's parameters, stepping as
``domino.train.pipeline_step`` does (backward, ``zero_step.take_reduced_gradients``, ``step``); the last stage's
gradient is infinite on the second step; then an asynchronous save's snapshot whose host copies fail on the last stage.
"""

import pytest
import torch

from distributed_helpers import run_distributed


def _body(rank, world_size, save):
    from domino.checkpoint import checkpointing
    from domino.config import parse_config
    from domino.runtime.agreement import AgreedFailure
    from domino.optim import zero_step
    from domino.optim.deepspeed_optimizer import build_deepspeed_optimizer
    from domino.train import runtime_start

    config = parse_config(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                           "--seq-length", "4", "--max-position-embeddings", "4", "--vocab-size", "16",
                           "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "0.1",
                           "--train-iters", "2", "--zero-stage", "1", "--clip-grad", "0", "--save", save,
                           "--pipeline-model-parallel-size", "2",
                           "--distributed-timeout-minutes", "1"])  # a hang fails the test within a minute
    mesh = runtime_start.initialize_runtime(config)
    torch.manual_seed(rank)
    optimizer = build_deepspeed_optimizer(torch.nn.Linear(4, 4), config, mesh)
    engine = optimizer.engine  # DeepSpeed's, driven by hand: the stages' agreement is its optimizer's
    steps = []
    for factor in (1.0, float("inf") if rank == 1 else 1.0):
        loss = engine.module(torch.ones(2, 4)).sum() * factor
        loss.backward()
        zero_step.take_reduced_gradients(engine.optimizer)
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.step()
        steps.append({"changed": any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters())),
                      "skipped": float(zero_step.skip_flag(engine))})

    def to_host(tensor):
        if rank == 1:
            raise RuntimeError("CUDA error: out of memory (pinned host memory)")
        return tensor.detach().clone()

    try:
        checkpointing.collective("saving checkpoint iter_0000002 (copying its state)", lambda: (
            checkpointing.take_snapshot(optimizer, config, mesh, 2, 2, 16, "test", to_host=to_host)))
        snapshot_error = None
    except AgreedFailure as failure:
        snapshot_error = str(failure)
    return {"optimizer": type(engine.optimizer).__name__, "steps": steps, "snapshot_error": snapshot_error}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_body, 2, str(tmp_path_factory.mktemp("ckpt")))


def test_every_stage_skips_when_one_stages_gradients_overflow(results):
    for result in results:
        assert result["optimizer"] == "DeviceDecidedZeroOptimizer"
        first, second = result["steps"]
        assert first == {"changed": True, "skipped": 0.0}
        assert second == {"changed": False, "skipped": 1.0}, results  # stage 0 too, though its gradients are finite


def test_a_snapshot_failing_on_one_stage_fails_on_every_stage_with_one_line(results):
    errors = [r["snapshot_error"] for r in results]
    assert errors[0] == errors[1] and errors[0] is not None
    assert "rank 1 (node " in errors[0] and "rank 0 (node " not in errors[0]
    assert "saving checkpoint iter_0000002 (copying its state)" in errors[0] and "out of memory" in errors[0]
