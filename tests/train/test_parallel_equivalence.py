"""One optimizer step on the same global batch gives the same parameters in every parallel layout."""

import torch

from train_helpers import TINY, run_pretrain
from domino.checkpoint import model_shards, on_disk

# Adam's first step moves every weight by about lr * sign(grad); gradients that are exactly zero in theory
# (the key bias under softmax) are rounding noise whose sign differs between layouts. An epsilon far above
# that noise keeps the comparison about the math rather than about the sign of 1e-10.
COMMON = [*TINY, "--train-iters", "1", "--eval-iters", "0", "--eval-interval", "0", "--micro-batch-size", "4",
          "--global-batch-size", "8", "--lr-warmup-iters", "0", "--adam-eps", "1e-4"]
# TP=2 pads the vocabulary to a multiple of 128 x 2 by default; this keeps it at TP=1's 50304 rows.
SAME_VOCAB_AT_TP2 = ["--make-vocab-size-divisible-by", "64"]


def _params_after_one_step(tmp_path, corpus_prefix, name, nproc, layout):
    save = tmp_path / name
    run_pretrain([*COMMON, "--data-path", corpus_prefix, "--save", str(save), *layout], nproc=nproc)
    return model_shards.load_full_state_dict(on_disk.resolve_checkpoint_dir(save))


def _assert_close(reference, other):
    """Every tensor within 1e-5 of the reference, relative to the tensor's largest entry."""
    assert reference.keys() == other.keys()
    for key in reference:
        assert other[key].shape == reference[key].shape, key
        error = (other[key] - reference[key]).abs().max().item()
        assert error <= 1e-5 * reference[key].abs().max().item(), (key, error)


def test_dp2_zero2_matches_dp1(tmp_path, corpus_prefix):
    reference = _params_after_one_step(tmp_path, corpus_prefix, "dp1", 1, ["--zero-stage", "0"])
    dp2 = _params_after_one_step(tmp_path, corpus_prefix, "dp2", 2, ["--zero-stage", "2"])
    _assert_close(reference, dp2)


def test_tp2_domino_matches_tp1(tmp_path, corpus_prefix):
    reference = _params_after_one_step(tmp_path, corpus_prefix, "tp1", 1, [])
    tp2 = _params_after_one_step(tmp_path, corpus_prefix, "tp2", 2,
                                 ["--tensor-model-parallel-size", "2", "--domino-chunks", "2", *SAME_VOCAB_AT_TP2])
    _assert_close(reference, tp2)


def test_a_step_changes_the_weights(tmp_path, corpus_prefix):
    """Guards the comparisons above against a run that silently never updates."""
    trained = _params_after_one_step(tmp_path, corpus_prefix, "one", 1, [])
    untrained = _params_after_one_step(tmp_path, corpus_prefix, "zero-lr", 1, ["--lr", "0", "--min-lr", "0"])
    moved = [k for k in trained if not torch.equal(trained[k], untrained[k])]
    assert len(moved) >= len(trained) // 2
