"""kfp wrapper of the preprocess step (see ``step.py`` for the logic and ``README.md`` for usage)."""

from typing import Optional

from kfp import dsl
from kfp.dsl import Dataset, Output

from components import default_image


def preprocess(
    dataset: Output[Dataset],
    shared_root: str,
    run_id: str,
    corpus: str = "shakespeare",
    input_uri: str = "",
    tokenizer: str = "gpt2",
    json_keys: str = "text",
    workers: int = 1,
):
    """Tokenizes raw text (files on the shared volume, or a built-in corpus) into ``.bin/.idx``.

    Args:
        dataset: Manifest naming the tokenized files on the shared volume; its metadata holds
            documents, tokens, tokenizer, vocab_size, idx_sha256 and prefix.
        shared_root: Mount path of the shared volume (or a local folder when run locally).
        run_id: Unique run id; files go to ``<shared_root>/runs/<run_id>/data``.
        corpus: Built-in corpus (shakespeare, kjv, ...) used when ``input_uri`` is empty.
        input_uri: Comma-separated paths or file:// URIs of JSON-lines or text files.
        tokenizer: Tokenizer name or tokenizer.json path.
        json_keys: Comma-separated JSON keys to tokenize.
        workers: Tokenizer processes.
    """
    from components.preprocess.step import run_preprocess

    manifest = run_preprocess(
        dataset.path, shared_root, run_id, corpus=corpus, input_uri=input_uri,
        tokenizer=tokenizer, json_keys=json_keys, workers=workers,
    )
    dataset.metadata.update(manifest)


def build(image: Optional[str] = None):
    """The preprocess component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(preprocess, base_image=image or default_image(), install_kfp_package=False)
