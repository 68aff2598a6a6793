"""Fixture for training tests: a small preprocessed corpus, made once per session."""

import pytest


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> str:
    """A tokenised slice of the built-in Shakespeare corpus (GPT-2 BPE)."""
    from domino.data.preprocess import preprocess

    out = tmp_path_factory.mktemp("corpus")
    result = preprocess(None, str(out / "shakespeare"), builtin_corpus="shakespeare-small", workers=1, progress=False)
    return result.prefixes["text"]
