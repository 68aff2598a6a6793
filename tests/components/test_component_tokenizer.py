"""The train-tokenizer step: a BPE trained on a built-in corpus, the pass-through, and its input checks."""

import os

import pytest

from components.tokenizer.step import TokenizerSettings, run_train_tokenizer, tokenizer_dir
from domino.data.tokenizer import build_tokenizer


def _train(root, run_id, **kwargs):
    return run_train_tokenizer(TokenizerSettings(shared_root=str(root), run_id=run_id, **kwargs), log=lambda _: None)


def test_trains_a_bpe_on_the_corpus_into_the_run_folder(tmp_path):
    spec = _train(tmp_path, "run-1", corpus="shakespeare-small", tokenizer_vocab_size=400)
    assert spec == tokenizer_dir(str(tmp_path), "run-1") == str(tmp_path / "runs" / "run-1" / "data" / "tokenizer")
    tokenizer = build_tokenizer(spec)
    assert tokenizer.vocab_size == 400 and tokenizer.eod == 0
    text = "Thunder and lightning. Enter three Witches."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and len(ids) < 0.7 * len(text)  # merges learned from the plays


def test_vocab_size_zero_passes_the_named_tokenizer_on(tmp_path):
    assert _train(tmp_path, "r", tokenizer="gpt2", tokenizer_vocab_size=0) == "gpt2"
    assert _train(tmp_path, "r", tokenizer="", tokenizer_vocab_size=0) == "gpt2"  # not given: domino's default
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenizer_vocab_size": 100}, "tokenizer_vocab_size: 100 is below 257"),
    ({"tokenizer_vocab_size": 300, "corpus": "", "input_uri": ""}, "give input_uri or a built-in corpus"),
    ({"tokenizer_vocab_size": 300, "input_uri": "s3://bucket/a.txt"}, "input_uri: 's3://bucket/a.txt' uses scheme 's3'"),
    ({"tokenizer_vocab_size": 300, "corpus": "nope"}, "train-tokenizer: unknown built-in corpus 'nope'"),
])
def test_bad_input_is_named_before_anything_is_written(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _train(tmp_path, "r", **kwargs)
    assert not os.path.exists(tokenizer_dir(str(tmp_path), "r"))
