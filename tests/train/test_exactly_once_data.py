"""Exactly-once data across preemptions: a tiny run preempted three times (a real SIGTERM, --exit-signal-handler)
and resumed on another layout each time, TP 2 -> TP 1 x DP 2 -> DP 1 -> DP 2, reads every sample index once, in
the uninterrupted run's order (global batch by global batch).

The indices are observed where they are read: a wrapper around the run's real training dataset records each
``__getitem__`` on the data-reading ranks (TP rank 0; no loader workers, so a read is a trained sample), tagged
with the step it was read in. The global batch stays 4 (micro 1, accumulation 4 / DP), so each layout sees the
same sequence of batches; ``consumed_samples`` in the checkpoint is where each resumed run starts reading.
"""

import torch

from distributed_helpers import run_distributed

GLOBAL_BATCH, ITERS = 4, 12


def _segment(rank, world_size, save, tp, stop_at_call):
    import os
    import signal

    from domino.config import parse_config
    from domino.runtime import state
    from domino.train.runtime_start import initialize_runtime
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.pretrain import pretrain

    config = parse_config(["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--train-iters", str(ITERS),
                           "--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH), "--log-interval",
                           "100", "--eval-iters", "0", "--eval-interval", "0", "--num-workers", "0", "--seed", "7",
                           "--tensor-model-parallel-size", str(tp), "--save", save, "--load", save,
                           "--exit-signal-handler"])
    mesh = initialize_runtime(config)
    recipe = GPTRecipe(config, mesh)
    reads, calls = [], []

    class Recorded(torch.utils.data.Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, idx):
            reads.append((len(calls), int(idx)))  # the forward_step call (micro-batch) it is read for
            return self.inner[idx]

    def dataset_builder(counts):
        train, valid, test = recipe.dataset_builder(counts)
        return Recorded(train), valid, test

    def forward_step(data_iterator, model):
        if rank == 0 and len(calls) == stop_at_call:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption mid-step: acted on at a step boundary
        out = recipe.forward_step(data_iterator, model)
        calls.append(1)
        return out

    result = pretrain(config, recipe.model_builder, dataset_builder, forward_step, recipe.padded_vocab_size, mesh=mesh)
    per_step = GLOBAL_BATCH // state.get_data_parallel_world_size()  # micro-batches per step on this rank
    first = result.iteration - len(calls) // per_step
    return result.iteration, result.consumed_samples, [(first + call // per_step, idx) for call, idx in reads]


def _by_step(results):
    steps = {}
    for _, _, reads in results:
        for step, idx in reads:
            steps.setdefault(step, []).append(idx)
    return steps


def test_three_preemptions_across_layouts_read_each_sample_once_in_order(tmp_path):
    save = str(tmp_path / "ckpt")
    # (world size, TP, micro-batch call of rank 0 during which SIGTERM arrives; None: train to the end)
    layouts = [(2, 2, 5), (2, 1, 2), (1, 1, 5), (2, 1, None)]
    segments = [run_distributed(_segment, world, save, tp, -1 if stop is None else stop)
                for world, tp, stop in layouts]
    ends = [results[0][0] for results in segments]
    assert all(len({r[0] for r in results}) == 1 for results in segments)  # every rank stopped at one step
    assert ends[-1] == ITERS and ends == sorted(set(ends)) and len(ends) == 4, ends  # three real preemptions
    seen = {}
    for results in segments:
        for step, indices in _by_step(results).items():
            assert step not in seen, f"step {step} trained twice"
            seen[step] = sorted(indices)
    # The uninterrupted run's order: step s reads global batch s, samples [4 s, 4 s + 4), each exactly once.
    assert seen == {s: list(range(GLOBAL_BATCH * s, GLOBAL_BATCH * (s + 1))) for s in range(ITERS)}, seen
    assert [results[0][1] for results in segments] == [GLOBAL_BATCH * e for e in ends]  # consumed_samples
