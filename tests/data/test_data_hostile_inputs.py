"""Hostile preprocessing inputs: keys that would escape the output folder, JSON that breaks the parser,
documents too large to tokenise in one call, more workers than cores."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from domino.data.errors import DataError
from domino.data.indexed_dataset import IndexedDataset
from domino.data.preprocess import preprocess
from domino.data.tokenizer import Tokenizer


@pytest.mark.parametrize("key", ["x/../../victim", "..", "a..b", "a\\b", ""])
def test_json_keys_that_could_leave_the_output_folder_are_refused_before_any_work(tmp_path, key):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({key: "hello"}) + "\n")
    with pytest.raises(DataError, match="--json-keys: key .* may not be empty or contain a path separator or '..'"):
        preprocess([str(source)], str(tmp_path / "out" / "d"), json_keys=[key])
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_json_lines_that_raise_value_or_recursion_errors_are_bad_lines(tmp_path):
    source = tmp_path / "in.jsonl"
    deep, huge = "[" * 100_000, '{"text": ' + "9" * 5000 + "}"
    source.write_text("\n".join([json.dumps({"text": "first document"}), deep, huge,
                                 json.dumps({"text": "second document"})]) + "\n")
    with pytest.raises(DataError, match=r"in.jsonl:2: unreadable JSON \(RecursionError"):
        preprocess([str(source)], str(tmp_path / "strict"))
    result = preprocess([str(source)], str(tmp_path / "d"), skip_bad_lines=True)
    assert result.documents == 2 and result.skipped_lines == 2


def test_a_huge_document_is_encoded_slice_by_slice_into_the_same_one_document(tmp_path, monkeypatch):
    words = [f"w{i % 997}x" for i in range(30_000)]
    text = " ".join(words)  # ~200k characters, one line
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "short one"}) + "\n")
    whole = preprocess([str(source)], str(tmp_path / "whole"))
    calls = []
    real = Tokenizer.encode_batch
    monkeypatch.setattr(Tokenizer, "encode_batch", lambda self, texts: calls.append(max(map(len, texts))) or
                        real(self, texts))
    sliced = preprocess([str(source)], str(tmp_path / "sliced"), max_document_chars=10_000)
    assert max(calls) <= 10_000 and len(calls) >= len(text) // 10_000  # never more than the cap in one call
    a, b = IndexedDataset(whole.prefixes["text"]), IndexedDataset(sliced.prefixes["text"])
    assert len(a) == len(b) == 2
    assert np.array_equal(a.get(0), b.get(0)) and np.array_equal(a.get(1), b.get(1))  # cut before spaces


def test_workers_are_capped_at_the_cpus(tmp_path, caplog):
    source = tmp_path / "in.txt"
    source.write_text("one document\n\nanother one\n")
    with caplog.at_level(logging.WARNING):
        result = preprocess([str(source)], str(tmp_path / "d"), workers=100_000)
    assert result.documents == 2 and "--workers 100000 capped at the" in caplog.text


def test_token_ids_beyond_the_vocabulary_are_refused_when_the_dataset_is_opened(tmp_path, monkeypatch):
    from domino.data.dataset_builder import build_train_valid_test_datasets
    from domino.data.indexed_dataset import IndexedDatasetWriter

    prefix = str(tmp_path / "d")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for n in range(20):
            writer.add_document(np.arange(n, n + 10) % 250)
        writer.add_document(np.array([5, 300, 7]))  # id 300 at position 201
    scans = []
    real = IndexedDataset.first_token_outside
    monkeypatch.setattr(IndexedDataset, "first_token_outside",
                        lambda self, *args: scans.append(args) or real(self, *args))
    cache = str(tmp_path / "cache")

    def build(vocab_size):
        return build_train_valid_test_datasets([prefix], "1", [8, 0, 0], 4, 1, True, data_cache_path=cache,
                                               vocab_size=vocab_size)

    for _ in range(2):
        with pytest.raises(DataError, match=f"{prefix}.bin: token id 300 at position 201 is outside the "
                                            "vocabulary of 256 tokens"):
            build(256)
    assert len(scans) == 1  # the verdict is cached in the index cache
    assert build(301)[0] is not None and len(scans) == 2  # another vocabulary, another verdict
