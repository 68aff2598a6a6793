"""Shared pytest setup: CPU-only DeepSpeed, small thread counts, and the repo root on sys.path."""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import pytest  # noqa: E402  (after the environment above, as the tests' own imports are)


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> str:
    """A tokenised slice of the built-in Shakespeare corpus (GPT-2 BPE), made once per session."""
    from domino.data.preprocess import preprocess

    out = tmp_path_factory.mktemp("corpus")
    result = preprocess(None, str(out / "shakespeare"), builtin_corpus="shakespeare-small", workers=1, progress=False)
    return result.prefixes["text"]
