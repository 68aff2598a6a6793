"""evaluate_checkpoint: real datasets, EOD options, TP=2 and DP=2 on gloo equal to one process."""

import json
import math

import pytest
import torch

from distributed_helpers import run_distributed
from domino.config import ConfigError
from domino.eval.evaluate import evaluate_checkpoint
from domino.eval.settings import EvalSettings
from eval_checkpoints import run_cli, save_checkpoint, tiny_config, tiny_model, tiny_tokenizer, write_token_dataset


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("evaluate")
    tokenizer = tiny_tokenizer(root / "tok")
    prefix = write_token_dataset(root / "data" / "corpus", tokenizer.vocab_size, documents=16, eod=tokenizer.eod)
    config = tiny_config(str(root / "tok")).replace(data_path=[prefix], split="50,25,25",
                                                   data_cache_path=str(root / "cache"))
    model = tiny_model(config, tokenizer.vocab_size, seed=6)
    ckpts = {"tp1": str(save_checkpoint(root / "tp1", model, config, tp=1)),
             "tp2": str(save_checkpoint(root / "tp2", model, config, tp=2, tokenizer=tokenizer))}
    return root, prefix, ckpts, tokenizer


def _eval(ckpt, prefix, root, eval_iters=None, max_samples=None, **kwargs):
    """One pass at micro-batch 4 unless ``eval_iters`` or ``max_samples`` says otherwise."""
    settings = EvalSettings(eval_tokens=None, eval_iters=eval_iters, max_samples=max_samples, micro_batch_size=4)
    return evaluate_checkpoint(ckpt, prefix, settings, data_cache_path=str(root / "cache"), **kwargs)


def test_single_process_metrics(setup):
    root, prefix, ckpts, tokenizer = setup
    full = _eval(ckpts["tp1"], prefix, root)
    assert full["tokens"] == full["samples"] * 16 and full["batches"] >= 2
    assert math.isfinite(full["loss"]) and full["ppl"] == pytest.approx(math.exp(full["loss"]))
    assert 0.0 <= full["accuracy"] <= 1.0
    assert _eval(ckpts["tp2"], prefix, root) == {**full, "checkpoint": full["checkpoint"].replace("tp1", "tp2")}
    masked = _eval(ckpts["tp1"], prefix, root, eod_mask_loss=True)
    assert 0 < full["tokens"] - masked["tokens"] <= 16 + full["samples"]  # one EOD per document at most
    assert masked["loss"] != full["loss"]
    one = _eval(ckpts["tp1"], prefix, root, eval_iters=1)
    assert one["batches"] == 1 and one["samples"] == 4
    assert _eval(ckpts["tp1"], prefix, root, max_samples=5)["samples"] == 8  # whole micro-batches
    # Without --data-path: the test split of the checkpoint's own data (a quarter of the documents).
    test_split = evaluate_checkpoint(ckpts["tp1"], settings=EvalSettings(eval_tokens=None, micro_batch_size=1))
    assert 0 < test_split["samples"] < full["samples"] and "test split 50,25,25" in test_split["data"]


def _distributed_body(rank, world, ckpts, prefix, root):
    from domino.runtime import state

    out = {name: _eval(ckpt, prefix, root) for name, ckpt in ckpts.items()}  # TP=2
    state.destroy_model_parallel()
    out["dp2"] = evaluate_checkpoint(ckpts["tp1"], prefix, EvalSettings(eval_tokens=None, micro_batch_size=2),
                                     tensor_model_parallel_size=1,
                                     data_cache_path=str(root / "cache"))
    return out


def test_two_processes_match_one(setup):
    root, prefix, ckpts, _ = setup
    reference = _eval(ckpts["tp1"], prefix, root)
    for per_rank in run_distributed(_distributed_body, 2, ckpts, prefix, root):
        for name, got in per_rank.items():
            assert (got["tokens"], got["samples"]) == (reference["tokens"], reference["samples"]), name
            assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5), name
            assert got["accuracy"] == pytest.approx(reference["accuracy"], abs=1.5 / reference["tokens"]), name


def test_clear_errors(setup, tmp_path):
    root, prefix, ckpts, _ = setup
    with pytest.raises(ConfigError, match="does not exist"):
        evaluate_checkpoint(tmp_path / "none", prefix)
    with pytest.raises(ConfigError, match=str(tmp_path / "missing")):
        evaluate_checkpoint(ckpts["tp1"], str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="--seq-length 64"):
        evaluate_checkpoint(ckpts["tp1"], prefix, seq_length=64)
    with pytest.raises(ConfigError, match="fewer than one micro-batch"):
        evaluate_checkpoint(ckpts["tp1"], prefix, EvalSettings(micro_batch_size=1000),
                            data_cache_path=str(root / "cache"))


def test_a_dataset_of_another_tokenizer_is_refused(setup, tmp_path):
    """Token ids at or above the checkpoint tokenizer's vocabulary would index past the embedding (or, inside
    the padding, score garbage): the dataset is refused when it is opened, naming the file and the id."""
    root, _, ckpts, tokenizer = setup
    wider = write_token_dataset(tmp_path / "wider", tokenizer.vocab_size + 40, documents=16, seed=3)
    with pytest.raises(ConfigError, match=f"{wider}.bin: token id .* is outside the vocabulary of "
                                          f"{tokenizer.vocab_size} tokens"):
        evaluate_checkpoint(ckpts["tp1"], wider, data_cache_path=str(tmp_path / "cache"))


def _cli_json(capsys, *flags):
    code, out, _ = run_cli(["evaluate", *flags, "--json", "--no-progress"], capsys)
    assert code == 0
    return json.loads(out.strip().splitlines()[-1])


def test_evaluate_cli_defaults_to_a_bounded_budget_of_held_out_documents(setup, capsys):
    root, prefix, ckpts, _ = setup
    common = ["--load", ckpts["tp2"], "--data-path", prefix, "--micro-batch-size", "4",
              "--data-cache-path", str(root / "cache")]
    # Default: the test part of the checkpoint's own split (50,25,25), within the default token budget.
    held_out = _cli_json(capsys, *common)
    assert "test split 50,25,25" in held_out["data"]
    assert held_out["loss"] == pytest.approx(_eval(ckpts["tp1"], prefix, root, split="50,25,25")["loss"])
    # A stated budget: 32 tokens = 2 samples of 16, rounded up to one micro-batch of 4.
    assert _cli_json(capsys, *common, "--eval-tokens", "32")["samples"] == 4
    # Everything only when asked: every document, all of it.
    everything = _cli_json(capsys, *common, "--split", "0,0,1", "--eval-tokens", "all")
    assert everything["loss"] == pytest.approx(_eval(ckpts["tp1"], prefix, root)["loss"])
    code, _, err = run_cli(["evaluate", *common, "--eval-tokens", "0"], capsys)
    assert code == 2 and "--eval-tokens: must be at least 1 (or 'all'), got 0" in err
