"""Non-finite losses: the update is skipped and counted; too many in a row stop the run with a message.

These drive ``pretrain()`` in-process with a wrapped ``forward_step`` (the public extension point) that
poisons chosen micro-batches, inside a real one-rank torch.distributed process.
"""

import json

import pytest

from distributed_helpers import run_distributed


def _train_with_poisoned_steps(rank, world_size, prefix, out_dir, poisoned, max_nan_steps, extra=(), fused=True):
    import torch

    from domino.config import parse_config
    from domino.optim import clipping
    from domino.train import runtime_start

    if not fused:  # as on torch < 2.4, whose CPU AdamW has no fused kernel (and so no found_inf)
        clipping.fused_optimizer_supported = lambda device: False
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.pretrain import TrainingDivergedError, pretrain

    config = parse_config(["--preset", "tiny", "--data-path", prefix, "--train-iters", "8", "--log-interval", "1",
                           "--eval-iters", "0", "--eval-interval", "0", "--num-workers", "0", "--save", out_dir,
                           "--save-interval", "1", "--metrics-file", f"{out_dir}/metrics.jsonl",
                           "--max-nan-steps", str(max_nan_steps), *extra])
    mesh = runtime_start.initialize_runtime(config)
    recipe = GPTRecipe(config, mesh)
    calls = []

    def forward_step(data_iterator, model):
        output, loss_fn = recipe.forward_step(data_iterator, model)
        calls.append(1)
        if len(calls) in poisoned:
            output = output * float("nan")
        return output, loss_fn

    try:
        pretrain(config, recipe.model_builder, recipe.dataset_builder, forward_step, recipe.padded_vocab_size,
                 mesh=mesh)
    except TrainingDivergedError as error:
        return str(error)
    return None


def _records(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _weights(out_dir, iteration):
    from domino.checkpoint import model_shards

    return model_shards.load_full_state_dict(out_dir / f"iter_{iteration:07d}")


@pytest.mark.parametrize("flags,fused", [(("--zero-stage", "1"), True), (("--zero-stage", "0"), True),
                                         (("--zero-stage", "0"), False), (("--zero-stage", "1", "--bf16"), True)])
def test_nan_steps_are_skipped_and_counted(tmp_path, corpus_prefix, flags, fused):
    """ZeRO 1: DeepSpeed's optimizer skips from its overflow flag; ZeRO 0 (fp32, domino clips): the fused AdamW
    skips from the ``found_inf`` flag domino sets on the device (without a fused AdamW, domino decides on the
    host and zeroes the update); bf16 ZeRO 1: DeepSpeed's BF16_Optimizer with the step of
    ``domino.optim.bf16_step``, which skips on the device too and hands its flag to the interval's count."""
    import torch

    error, = run_distributed(_train_with_poisoned_steps, 1, corpus_prefix, str(tmp_path), {3, 4}, 3, flags, fused)
    assert error is None
    records = _records(tmp_path)
    assert [r["skipped_iterations"] for r in records] == [0, 0, 1, 2, 2, 2, 2, 2]
    assert all(r["lm_loss"] == r["lm_loss"] for r in records if r["iteration"] not in (3, 4))
    before, after = _weights(tmp_path, 2), _weights(tmp_path, 4)
    assert all(torch.equal(before[k], after[k]) for k in before)  # skipped updates left the weights alone
    assert not all(torch.equal(after[k], _weights(tmp_path, 5)[k]) for k in after)  # training went on


def test_persistent_nan_stops_with_a_clear_message(tmp_path, corpus_prefix):
    error, = run_distributed(_train_with_poisoned_steps, 1, corpus_prefix, str(tmp_path), set(range(3, 100)), 3)
    assert error is not None
    assert "NaN/inf for 3 consecutive iterations" in error and "--max-nan-steps 3" in error
