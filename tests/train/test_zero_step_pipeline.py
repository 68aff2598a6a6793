"""With pipeline stages, the device-decided ZeRO step (``domino.train.zero_step``) skips on every stage when one
stage's gradients are not finite.

DeepSpeed 0.19.8's ZeRO optimizer reduces its norm and overflow over the data-parallel group and its ``mpu``'s
model-parallel group (``_model_parallel_all_reduce``, ``runtime/zero/stage_1_and_2.py``), which is domino's
tensor-parallel group: alone, a stage with finite gradients would step while the stage with an overflow skips,
and their weights and Adam step counts would part for the rest of the run. Two real gloo ranks, one per stage,
each holding a stage's parameters, step as ``domino.train.pipeline_step`` does (backward, ``allreduce_gradients``,
``step``); the last stage's gradient is infinite on the second step.
"""

import torch

from distributed_helpers import run_distributed


def _body(rank, world_size):
    from domino.config import parse_config
    from domino.train import engine as engine_setup

    config = parse_config(["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                           "--seq-length", "4", "--max-position-embeddings", "4", "--vocab-size", "16",
                           "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "0.1",
                           "--train-iters", "2", "--zero-stage", "1", "--clip-grad", "0",
                           "--pipeline-model-parallel-size", "2"])
    engine_setup.initialize_runtime(config)
    torch.manual_seed(rank)
    engine = engine_setup.build_engine(torch.nn.Linear(4, 4), config)
    steps = []
    for factor in (1.0, float("inf") if rank == 1 else 1.0):
        loss = engine.module(torch.ones(2, 4)).sum() * factor
        loss.backward()
        engine.allreduce_gradients()
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.step()
        steps.append({"changed": any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters())),
                      "skipped": float(engine_setup.device_skip_flag(engine))})
    return {"optimizer": type(engine.optimizer).__name__, "steps": steps}


def test_every_stage_skips_when_one_stages_gradients_overflow():
    results = run_distributed(_body, 2)
    for result in results:
        assert result["optimizer"] == "DeviceDecidedZeroOptimizer"
        first, second = result["steps"]
        assert first == {"changed": True, "skipped": 0.0}
        assert second == {"changed": False, "skipped": 1.0}, results  # stage 0 too, though its gradients are finite
