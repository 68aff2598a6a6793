"""Artifact manifests are written atomically: a write that fails half-way leaves the previous manifest."""

import json

import pytest

from components.manifest import read_manifest, write_manifest


def test_a_manifest_write_that_fails_midway_keeps_the_old_manifest_whole(tmp_path):
    path = str(tmp_path / "artifacts" / "dataset")
    write_manifest(path, {"prefix": "/mnt/domino/datasets/a/corpus_text_document", "documents": 3})
    with pytest.raises(TypeError):
        write_manifest(path, {"documents": 4, "prefix": "/new", "zz": object()})  # not JSON: fails after "prefix"
    assert read_manifest(path, "dataset") == {"prefix": "/mnt/domino/datasets/a/corpus_text_document", "documents": 3}
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == ["dataset"]
    write_manifest(path, {"documents": 5})
    assert json.loads(open(path).read()) == {"documents": 5}
