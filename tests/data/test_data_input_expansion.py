"""Inputs expanded once: a symlinked folder inside an input directory is read, a link loop ends, and a file named
twice (another path, a link, a glob through a link) is read once with one line saying so."""

from __future__ import annotations

import json
import logging
import os

import pytest

from domino.data.preprocess import preprocess


def _jsonl(path, *texts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))


@pytest.fixture
def corpus(tmp_path):
    """corpus/{top.jsonl, v3/a.jsonl, current -> v3, loop -> ., shared -> ../elsewhere}, elsewhere/s.jsonl."""
    _jsonl(tmp_path / "corpus" / "top.jsonl", "the top document")
    _jsonl(tmp_path / "corpus" / "v3" / "a.jsonl", "the third version")
    _jsonl(tmp_path / "elsewhere" / "s.jsonl", "a shared document", "and another")
    os.symlink("v3", tmp_path / "corpus" / "current")
    os.symlink(".", tmp_path / "corpus" / "loop")
    os.symlink(os.path.join("..", "elsewhere"), tmp_path / "corpus" / "shared")
    return tmp_path / "corpus"


def _duplicate_lines(caplog):
    return [r.getMessage() for r in caplog.records if "named more than once" in r.getMessage()]


def test_a_directory_follows_its_symlinked_folders_each_once(corpus, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        result = preprocess([str(corpus)], str(tmp_path / "out" / "d"))
    assert result.documents == 4  # top, a (by one of its two names), and the two of the linked folder
    assert _duplicate_lines(caplog) == []  # a folder reached again is not entered: nothing named twice


def test_a_glob_through_a_link_loop_names_each_file_once(corpus, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        result = preprocess([str(corpus / "**" / "*.jsonl")], str(tmp_path / "out" / "d"))
    assert result.documents == 4  # glob's own walk named top.jsonl 40 times through loop/loop/...


def test_one_file_by_two_names_is_read_once_with_one_line(corpus, tmp_path, caplog):
    relative = os.path.relpath(corpus / "top.jsonl")
    with caplog.at_level(logging.WARNING):
        result = preprocess([str(corpus / "top.jsonl"), relative, str(corpus / "current" / "a.jsonl"),
                             str(corpus / "v3" / "a.jsonl")], str(tmp_path / "out" / "d"))
    assert result.documents == 2
    (line,) = _duplicate_lines(caplog)
    assert line == (f"input: 2 file(s) named more than once are read once: {relative} (is {corpus / 'top.jsonl'}), "
                    f"{corpus / 'current' / 'a.jsonl'} (is {corpus / 'v3' / 'a.jsonl'})")
