"""The preprocess stage's ParallelFor fan-out, run by kfp.local, twice: the second run reuses the dataset.

The stage is the one the gpt-pretrain pipeline compiles (``pipelines/preprocess_stage.py``), wrapped in a
pipeline of its own so that the test runs no training. kfp.local 2.17 runs ``dsl.ParallelFor`` over a
task's list output and ``dsl.Collected`` (``kfp/local/orchestrator/enhanced_dag_orchestrator.py``).
"""

import functools
import gzip
import json
import os

import pyarrow as pa
import pytest
import pyarrow.parquet as pq
import zstandard
from kfp import dsl, local

from domino.data.preprocess import preprocess
from pipelines.gpt_pretrain import task_arguments
from pipelines.preprocess_stage import PreprocessStage

RECORDS = [{"text": f"shard test document {i} " + "token " * (i % 13)} for i in range(120)]


def _jsonl(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _stage_pipeline():
    stage = PreprocessStage(parallelism=2)

    @dsl.pipeline(name="preprocess-stage")
    def pipeline(shared_root: str, input_uri: str, preprocess_groups: int = 2, reuse_dataset: bool = True):
        values = {"shared_root": shared_root, "corpus": "", "input_uri": input_uri,
                  "preprocess_groups": preprocess_groups, "reuse_dataset": reuse_dataset}
        stage(lambda task: task.set_caching_options(False), functools.partial(task_arguments, values), "gpt2")

    return pipeline


def _run(pipeline, artifacts, **arguments):
    before = set(os.listdir(artifacts)) if os.path.isdir(artifacts) else set()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(artifacts), raise_on_error=True)
    pipeline(**arguments)
    (run,) = set(os.listdir(artifacts)) - before
    with open(os.path.join(artifacts, run, "merge-datasets", "dataset"), encoding="utf-8") as handle:
        return json.load(handle), sorted(os.listdir(os.path.join(artifacts, run)))


@pytest.mark.filterwarnings("ignore:.*custom or non-Python base image:RuntimeWarning")
def test_parallel_for_over_shard_groups_then_merge_and_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())  # the steps import this checkout's components
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(RECORDS[:40])))
    (corpus / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(RECORDS[40:80])))
    pq.write_table(pa.table({"text": [r["text"] for r in RECORDS[80:]]}), str(corpus / "c.parquet"))
    (tmp_path / "all.jsonl").write_bytes(_jsonl(RECORDS))
    preprocess([str(tmp_path / "all.jsonl")], str(tmp_path / "whole"))
    pipeline = _stage_pipeline()
    shared = str(tmp_path / "shared")

    first, tasks = _run(pipeline, tmp_path / "artifacts", shared_root=shared, input_uri=str(corpus))
    # Two iterations of the loop ran, one per shard group, then the merge.
    assert [t for t in tasks if "iteration" in t] == [f"for-loop-1-iteration-{i}" for i in range(2)]
    assert (first["reused"], first["groups"], first["groups_tokenized"]) == (False, 2, 2)
    for ext in ("bin", "idx"):
        assert open(f"{first['prefix']}.{ext}", "rb").read() == (tmp_path / f"whole_text_document.{ext}").read_bytes()

    second, _ = _run(pipeline, tmp_path / "artifacts", shared_root=shared, input_uri=str(corpus))
    assert (second["reused"], second["groups_tokenized"]) == (True, 0)
    assert second["prefix"] == first["prefix"] and second["idx_sha256"] == first["idx_sha256"]
