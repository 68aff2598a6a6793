"""The report's measures of quality: the unigram baseline and the share of corpus words in samples."""

import math

import numpy as np
import pytest

from domino.data.indexed_dataset import IndexedDatasetWriter
from domino.eval.quality import corpus_words, unigram_baseline, word_fraction, words


def _dataset(path, documents):
    prefix = str(path / "corpus")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for tokens in documents:
            writer.add_document(np.asarray(tokens, dtype=np.uint16))
    return prefix


def test_unigram_baseline_matches_a_direct_computation(tmp_path):
    # 8 training documents, 1 validation, 1 test (split 80,10,10 over 10 documents).
    train = [[1, 1, 2, 3]] * 8
    prefix = _dataset(tmp_path, train + [[4, 4]] + [[1, 2, 5, 1]])
    result = unigram_baseline(prefix, "80,10,10", vocab_size=6)
    counts = np.ones(6)
    for document in train:
        for token in document:
            counts[token] += 1
    p = counts / counts.sum()
    expected = -np.mean(np.log(p[[1, 2, 5, 1]]))
    assert result["loss"] == pytest.approx(expected) and result["ppl"] == pytest.approx(math.exp(expected))
    assert result["tokens"] == 4 and result["accuracy"] == pytest.approx(0.5)  # token 1 is the most frequent
    with pytest.raises(ValueError, match="leaves no training or no test document"):
        unigram_baseline(prefix, "100,0,0", vocab_size=6)


def test_words_and_the_share_found_in_the_corpus():
    assert words("O Romeo, star-cross'd lovers! 'Tis 2 o'clock") == [
        "o", "romeo", "star", "cross'd", "lovers", "tis", "o'clock"]
    vocabulary = {"to", "be", "or", "not"}
    assert word_fraction(["To be, or nott", "to BE"], vocabulary) == (5, 6)
    assert word_fraction(["", "..."], vocabulary) == (0, 0)


class _CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_corpus_words_decodes_every_document(tmp_path):
    prefix = _dataset(tmp_path, [[ord(c) for c in "Fair is foul"], [ord(c) for c in "and foul is fair."]])
    assert corpus_words(prefix, _CharTokenizer()) == {"fair", "is", "foul", "and"}
