"""How good a model is, in terms a reader can check: a unigram baseline and the words of its samples.

* :func:`unigram_baseline`: the perplexity of the simplest model of the same tokenizer, one that predicts
  every token from its frequency in the training documents (add-one smoothed), on the test documents. A
  language model that learned anything beyond token frequencies beats it; the ratio says by how much.
* :func:`corpus_words` and :func:`word_fraction`: the share of the words of generated text that occur
  in the corpus. A model that learned the corpus's words writes them; one that did not writes fragments.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterable, Set, Tuple

import numpy as np

from domino.data.indexed_dataset import IndexedDataset
from domino.data.sample_index import split_boundaries

#: A word: letters, with inner apostrophes ("cross'd", "o'er"); hyphens and digits separate words.
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


def words(text: str) -> list:
    """The lower-cased words of ``text`` (see :data:`WORD`)."""
    return [match.group(0).lower() for match in WORD.finditer(text)]


def _split_documents(prefix: str, split: str) -> Tuple[Any, range, range]:
    dataset = IndexedDataset(prefix)
    bounds = split_boundaries(split, dataset.num_documents)
    return dataset, range(bounds[0], bounds[1]), range(bounds[2], bounds[3])


def unigram_baseline(prefix: str, split: str, vocab_size: int) -> Dict[str, Any]:
    """Loss, perplexity and accuracy of a unigram model on the test documents of ``split``.

    The model is fitted on the training documents (Megatron's document split, as training uses) with
    add-one smoothing over ``vocab_size`` tokens, so an unseen test token has a finite loss.

    Returns:
        ``{"loss", "ppl", "accuracy", "tokens"}``: mean cross-entropy in nats per token, its exponential,
        the share of test tokens equal to the most frequent training token, and the test tokens counted.

    Raises:
        ValueError: the split leaves no training or no test document.
    """
    dataset, train, test = _split_documents(prefix, split)
    if not len(train) or not len(test):
        raise ValueError(f"--split {split} leaves no training or no test document of {prefix}")
    counts = np.ones(vocab_size, dtype=np.float64)
    for document in train:
        counts += np.bincount(dataset.get_document(document), minlength=vocab_size)[:vocab_size]
    log_p = np.log(counts / counts.sum())
    total, nll, hits = 0, 0.0, 0
    best = int(np.argmax(counts))
    for document in test:
        tokens = np.asarray(dataset.get_document(document), dtype=np.int64)
        nll -= float(log_p[tokens].sum())
        hits += int((tokens == best).sum())
        total += len(tokens)
    loss = nll / total
    return {"loss": loss, "ppl": math.exp(loss), "accuracy": hits / total, "tokens": total}


def corpus_words(prefix: str, tokenizer) -> Set[str]:
    """Every word (see :data:`WORD`) of the tokenized corpus at ``prefix``, decoded document by document."""
    vocabulary: Set[str] = set()
    for tokens in IndexedDataset(prefix).iter_documents():
        vocabulary.update(words(tokenizer.decode(tokens.tolist())))
    return vocabulary


def word_fraction(texts: Iterable[str], vocabulary: Set[str]) -> Tuple[int, int]:
    """``(words of texts found in vocabulary, all words of texts)``."""
    found = total = 0
    for text in texts:
        for word in words(text):
            total += 1
            found += word in vocabulary
    return found, total
