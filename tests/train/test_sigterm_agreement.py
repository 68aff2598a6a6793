"""--exit-signal-handler agrees at every step boundary without a device sync: when one rank alone gets SIGTERM,
every rank stops at the same iteration, the one after the signal (the flag is all-reduced asynchronously on a
gloo group and read one step later, domino.train.preemption), not at the next log interval."""

from distributed_helpers import run_distributed


def _train_signalled(rank, world_size, signal_rank, signal_at_call):
    import os
    import signal

    from domino.config import parse_config
    from domino.train.runtime_start import initialize_runtime
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.pretrain import pretrain

    config = parse_config(["--preset", "tiny", "--mock-data", "--vocab-size", "512", "--train-iters", "8",
                           "--log-interval", "4", "--eval-iters", "0", "--eval-interval", "0", "--num-workers", "0",
                           "--exit-signal-handler"])
    mesh = initialize_runtime(config)
    recipe = GPTRecipe(config, mesh)
    calls = []

    def forward_step(data_iterator, model):
        calls.append(1)
        if rank == signal_rank and len(calls) == signal_at_call:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag
        return recipe.forward_step(data_iterator, model)

    result = pretrain(config, recipe.model_builder, recipe.dataset_builder, forward_step, recipe.padded_vocab_size, mesh=mesh)
    return result.iteration, result.interrupted


def test_one_signalled_rank_stops_every_rank_at_the_next_step():
    # DP=2, log interval 4; rank 1 is signalled during iteration 2: its flag goes out at the end of iteration 2
    # and is read at the end of iteration 3, on both ranks (before the fix: the log boundary, iteration 4).
    results = run_distributed(_train_signalled, 2, 1, 2)
    assert results == [(3, True), (3, True)]
