"""The train-tokenizer step: a BPE trained on a built-in corpus, the pass-through, and its input checks."""

import os

import pytest

from components.tokenizer.step import run_train_tokenizer, tokenizer_dir
from domino.data.tokenizer import build_tokenizer


def test_trains_a_bpe_on_the_corpus_into_the_run_folder(tmp_path):
    spec = run_train_tokenizer(str(tmp_path), "run-1", corpus="shakespeare-small", vocab_size=400, log=lambda _: None)
    assert spec == tokenizer_dir(str(tmp_path), "run-1") == str(tmp_path / "runs" / "run-1" / "data" / "tokenizer")
    tokenizer = build_tokenizer(spec)
    assert tokenizer.vocab_size == 400 and tokenizer.eod == 0
    text = "Thunder and lightning. Enter three Witches."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and len(ids) < 0.7 * len(text)  # merges learned from the plays


def test_vocab_size_zero_passes_the_named_tokenizer_on(tmp_path):
    assert run_train_tokenizer(str(tmp_path), "r", tokenizer="gpt2", vocab_size=0, log=lambda _: None) == "gpt2"
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("kwargs, message", [
    ({"vocab_size": 100}, "tokenizer_vocab_size: 100 is below 257"),
    ({"vocab_size": 0, "tokenizer": ""}, "tokenizer: empty"),
    ({"vocab_size": 300, "corpus": "", "input_uri": ""}, "give input_uri or a built-in corpus"),
    ({"vocab_size": 300, "input_uri": "s3://bucket/a.txt"}, "input_uri: 's3://bucket/a.txt' uses scheme 's3'"),
    ({"vocab_size": 300, "corpus": "nope"}, "train-tokenizer: unknown built-in corpus 'nope'"),
])
def test_bad_input_is_named_before_anything_is_written(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_train_tokenizer(str(tmp_path), "r", **kwargs, log=lambda _: None)
    assert not os.path.exists(tokenizer_dir(str(tmp_path), "r"))
