"""kfp wrapper of the train-tokenizer step (see ``step.py`` for the logic and ``README.md`` for usage)."""

from typing import Optional

from kfp import dsl

from components import default_image


def train_tokenizer(
    shared_root: str,
    run_id: str,
    corpus: str = "shakespeare",
    input_uri: str = "",
    tokenizer: str = "gpt2",
    vocab_size: int = 0,
) -> str:
    """Trains a byte-level BPE on the run's corpus (``vocab_size`` > 0) or passes ``tokenizer`` on.

    Args:
        shared_root: Mount path of the shared volume (or a local folder when run locally).
        run_id: Unique run id; a trained tokenizer goes to ``<shared_root>/runs/<run_id>/data/tokenizer``.
        corpus: Built-in corpus (shakespeare, kjv, ...) used when ``input_uri`` is empty.
        input_uri: Comma-separated paths or file:// URIs of JSON-lines or text files.
        tokenizer: Tokenizer name or path used when ``vocab_size`` is 0.
        vocab_size: Tokens of the BPE to train (0: train none, use ``tokenizer``).

    Returns:
        The tokenizer spec that preprocess and pretrain use (the trained folder, or ``tokenizer``).
    """
    from components.tokenizer.step import run_train_tokenizer

    return run_train_tokenizer(shared_root, run_id, corpus=corpus, input_uri=input_uri, tokenizer=tokenizer,
                               vocab_size=vocab_size)


def build(image: Optional[str] = None):
    """The train-tokenizer component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(train_tokenizer, base_image=image or default_image(), install_kfp_package=False)
