"""A pipelined ZeRO-1 step reduces the gradients over the data-parallel replicas once, and hands DeepSpeed's step
what the former second reduction did.

`pretrain` of :data:`pipeline_runs.TIED_TINY` (clipped every step) on 2 stages x 2 replicas at ZeRO 1, fp32 then
fp16, in one launch of gloo ranks (fp16 with DeepSpeed's CPU gate opened, as ``test_pipeline_fp16`` does). The step
averages the gradients over the replicas itself before clipping (:mod:`domino.train.pipeline_step`); DeepSpeed's
ZeRO optimizer then takes each rank's partition of them as they are
(:func:`domino.optim.zero_step.take_reduced_gradients`). At every step the former path
(``engine.allreduce_gradients()``, DeepSpeed's ``reduce_gradients``) runs first on the same gradients, then the
new one, and every reduction over the replicas' group is counted: the former all-reduces every gradient, the new
path nothing. The partition each leaves for the step (``averaged_gradients``, all ``step`` reads) is the same bit
for bit in fp32, so are the losses and norms that follow; in fp16 it is the same but where DeepSpeed's division of
the fp16 gradients by the replicas before summing them rounded a subnormal's last bit away.
"""

from __future__ import annotations

import json

import torch

from distributed_helpers import run_distributed
from pipeline_runs import TIED_TINY

ARGS = ["--train-iters", "3", "--eval-iters", "0", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
        "--zero-stage", "1"]
PRECISIONS = {"fp32": [], "fp16": ["--fp16", "--initial-loss-scale", "256"]}


def _counted_pretrain(rank, world_size, out_dir):
    """`pretrain` of TIED_TINY ARGS in each of :data:`PRECISIONS` (one launch: the ranks start once) whose every ZeRO
    hand-over runs the former path first, then the new one on the same gradients. Returns, per precision and step,
    the element counts of the reductions over the replicas' group each path made, and the flat partitions each
    left for DeepSpeed's step (the former's, the new one's, alternately)."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from domino.config import parse_config
    from domino.optim import zero_step
    from domino.optim.deepspeed_optimizer import DeepSpeedOptimizer
    from domino.runtime import state
    from domino.train import runtime_start
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.pretrain import pretrain

    CPU_Accelerator.is_fp16_supported = lambda self: True  # test_pipeline_fp16's module docstring
    runtime_start.check_this_device = lambda config: None
    replicas, counting, engines = set(), [None], []

    def counted(collective):
        def call(*positional, **keywords):
            if counting[0] is not None and keywords.get("group") in replicas:
                tensors = [t for t in (*positional, *keywords.values()) if isinstance(t, torch.Tensor)]
                counting[0][-1].append(max(t.numel() for t in tensors))
            return collective(*positional, **keywords)
        return call

    # DeepSpeed's comm calls torch.distributed's by attribute (deepspeed 0.19.8 comm/torch.py), with group=.
    for name in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
        setattr(dist, name, counted(getattr(dist, name)))
    take = zero_step.take_reduced_gradients
    init = DeepSpeedOptimizer.__init__

    def keep_engine(self, engine, *rest):
        engines.append(engine)
        init(self, engine, *rest)

    DeepSpeedOptimizer.__init__ = keep_engine

    def flat(optimizer):
        return [torch.cat([g.reshape(-1) for g in grads]).clone() for _, grads in sorted(
            optimizer.averaged_gradients.items())]

    results = {}
    for precision, args in PRECISIONS.items():
        counts, partitions = {"former": [], "new": []}, []

        def both_paths(optimizer):
            params = [p for group in optimizer.bit16_groups for p in group if p.grad is not None]
            grads = [p.grad.clone() for p in params]
            for path, run in (("former", engines[-1].allreduce_gradients), ("new", lambda: take(optimizer))):
                counts[path].append([])
                counting[0] = counts[path]
                run()
                counting[0] = None
                partitions.append(flat(optimizer))
                if path == "former":  # the same gradients again, as the step had them
                    optimizer.averaged_gradients.clear()
                    for p, grad in zip(params, grads):
                        p.grad = grad

        zero_step.take_reduced_gradients = both_paths
        config = parse_config([*TIED_TINY, *ARGS, *args, "--metrics-file", f"{out_dir}/{precision}.jsonl"])
        mesh = runtime_start.initialize_runtime(config)
        replicas.update({mesh.dp.process_group, mesh.dp_cp.process_group})
        recipe = GPTRecipe(config, mesh)
        pretrain(config, recipe.model_builder, recipe.dataset_builder, recipe.forward_step, recipe.padded_vocab_size,
                 get_batch=recipe.batch, mesh=mesh)
        dist.barrier()
        state.destroy_model_parallel()
        results[precision] = counts, partitions
    return results


def test_a_pipelined_zero1_step_reduces_the_gradients_once_and_hands_zero_the_same_partition(tmp_path):
    results = run_distributed(_counted_pretrain, 4, str(tmp_path))
    for precision in PRECISIONS:
        records = [json.loads(line) for line in (tmp_path / f"{precision}.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in records if "eval" not in r] == [1, 2, 3]
        for counts, partitions in (result[precision] for result in results):
            assert len(counts["former"]) == len(counts["new"]) == 3
            # The former path's second reduction of every gradient is visible to the count; the new path makes none.
            assert all(max(step) > 1000 for step in counts["former"]), counts["former"]
            assert counts["new"] == [[], [], []], precision
            for former, new in zip(partitions[::2], partitions[1::2]):
                for a, b in zip(former, new):
                    if precision == "fp16":
                        # DeepSpeed divided the fp16 gradients by the 2 replicas before summing them
                        # (stage_1_and_2.py `allreduce_bucket`): a subnormal loses its last bit there.
                        b = (b / 2) * 2
                    assert torch.equal(a, b), precision
