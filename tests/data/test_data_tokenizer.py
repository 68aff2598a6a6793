"""Tokenizers: GPT-2 known ids, save/load round trips, trained BPE, Hugging Face interoperability."""

import json
import os

import pytest

from domino.data.errors import DataError
from domino.data.tokenizer import build_tokenizer
from domino.data.tokenizer_training import train_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("gpt2")


def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.eod == 50256 and gpt2.eod_token == "<|endoftext|>"
    assert gpt2.vocab_size == 50257
    assert gpt2.encode(" the") == [262]
    # the end-of-document token in text is one special id, never split
    assert gpt2.encode("a<|endoftext|>b") == [64, 50256, 65]
    assert gpt2.encode_batch(["Hello world", "", " the"]) == [[15496, 995], [], [262]]


def test_gpt2_decode_round_trip(gpt2):
    text = "Tüdelü  naïve\n\n\tcafé — 東京 🙂"
    assert gpt2.decode(gpt2.encode(text)) == text


def test_save_and_rebuild_gpt2(gpt2, tmp_path):
    gpt2.save(str(tmp_path))
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / name).is_file()
    text = "Rebuilt tokenizers agree. <|endoftext|> Yes."
    assert build_tokenizer(str(tmp_path)).encode(text) == gpt2.encode(text)
    # without tokenizer.json the vocab.json + merges.txt pair is used
    os.remove(tmp_path / "tokenizer.json")
    rebuilt = build_tokenizer(str(tmp_path))
    assert rebuilt.encode(text) == gpt2.encode(text) and rebuilt.eod == 50256
    assert json.loads((tmp_path / "vocab.json").read_text())["<|endoftext|>"] == 50256


def test_transformers_loads_saved_gpt2(gpt2, tmp_path):
    import transformers

    gpt2.save(str(tmp_path))
    hf = transformers.GPT2TokenizerFast.from_pretrained(str(tmp_path))
    assert hf("Hello world")["input_ids"] == [15496, 995]
    assert hf.eos_token_id == 50256


def test_train_tokenizer_from_text(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"the quick brown fox number {i} jumps over the lazy dog" for i in range(200)))
    out = tmp_path / "tok"
    trained = train_tokenizer([str(corpus)], 300, str(out))
    assert trained.vocab_size == 300
    assert trained.eod_token == "<|endoftext|>"
    loaded = build_tokenizer(str(out))
    text = "the quick brown fox<|endoftext|>"
    assert loaded.encode(text) == trained.encode(text)
    assert loaded.encode(text)[-1] == loaded.eod
    assert loaded.decode(loaded.encode("the lazy dog")) == "the lazy dog"
    assert len(loaded.encode("the quick brown fox")) < len("the quick brown fox")  # merges were learnt


def test_bad_tokenizer_specs(tmp_path):
    with pytest.raises(DataError, match="neither 'gpt2' nor"):
        build_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(DataError, match="holds neither tokenizer.json"):
        build_tokenizer(str(tmp_path))
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(DataError, match="tokenizer.json"):
        build_tokenizer(str(broken))
    with pytest.raises(DataError, match="vocab-size"):
        train_tokenizer(None, 100, str(tmp_path / "x"), builtin_corpus="shakespeare-small")
