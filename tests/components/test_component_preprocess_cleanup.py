"""The preprocess stage (plan, groups, merge, reuse) on real corpora, its input checks, and the exit handler
against a fake Kubernetes API."""

import gzip
import hashlib
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from components.cleanup.step import cleanup_jobs
from components.merge.step import run_merge
from components.preprocess.step import plan_groups, resolve_inputs, run_group, run_preprocess, split_in_groups
from domino.data.errors import DataError
from domino.data.indexed_dataset import IndexedDataset
from domino.data.preprocess import preprocess


def test_preprocess_builtin_corpus_writes_dataset_and_manifest_then_reuses_it(tmp_path):
    manifest_path = str(tmp_path / "artifact" / "dataset")
    manifest = run_preprocess(manifest_path, str(tmp_path / "shared"), corpus="shakespeare-small")
    with open(manifest_path) as handle:
        assert json.load(handle) == manifest
    prefix = manifest["prefix"]
    key = manifest["dataset_key"]
    build = os.path.dirname(prefix)  # a build folder of its own, named by the record
    assert os.path.dirname(build) == str(tmp_path / "shared" / "datasets" / key / "builds")
    assert os.path.basename(prefix) == "corpus_text_document"
    with open(prefix + ".idx", "rb") as handle:
        assert hashlib.sha256(handle.read()).hexdigest() == manifest["idx_sha256"]
    dataset = IndexedDataset(prefix)
    assert len(dataset) == manifest["documents"] > 10
    assert sum(len(dataset[i]) for i in range(len(dataset))) == manifest["tokens"]
    assert manifest["vocab_size"] == 50257 and manifest["tokenizer"] == "gpt2"
    assert manifest["source"] == "builtin:shakespeare-small"
    assert (manifest["reused"], manifest["groups"], manifest["groups_tokenized"]) == (False, 1, 1)
    written = os.stat(prefix + ".bin").st_mtime_ns
    again = run_preprocess(str(tmp_path / "artifact2"), str(tmp_path / "shared"), corpus="shakespeare-small")
    assert again["reused"] and again["groups_tokenized"] == 0
    assert {k: v for k, v in again.items() if k not in ("reused", "groups_tokenized")} == {
        k: v for k, v in manifest.items() if k not in ("reused", "groups_tokenized")}
    assert os.stat(prefix + ".bin").st_mtime_ns == written  # nothing was rewritten
    forced = run_preprocess(str(tmp_path / "artifact3"), str(tmp_path / "shared"), corpus="shakespeare-small",
                            reuse=False)
    assert not forced["reused"] and forced["groups_tokenized"] == 1 and forced["idx_sha256"] == manifest["idx_sha256"]
    # reuse_dataset=false published a new build; the one other runs may be reading is left as it was.
    assert forced["prefix"] != prefix and os.stat(prefix + ".bin").st_mtime_ns == written
    record = json.load(open(tmp_path / "shared" / "datasets" / key / "corpus.record.json"))
    assert record["prefixes"]["text"] == forced["prefix"] and record["superseded"] == [os.path.basename(build)]


def _records(count, start=0):
    return [{"text": f"document {i} " + "words " * (i % 11)} for i in range(start, start + count)]


def _jsonl(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_shard_groups_merge_to_the_one_run_bytes_and_only_changed_groups_are_tokenised(tmp_path):
    records = _records(200)
    inputs = tmp_path / "corpus"
    inputs.mkdir()
    (inputs / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(records[:50])))
    (inputs / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(records[50:100])))
    pq.write_table(pa.table({"text": [r["text"] for r in records[100:150]]}), str(inputs / "c.parquet"))
    (inputs / "d.jsonl").write_bytes(_jsonl(records[150:]))
    (tmp_path / "all.jsonl").write_bytes(_jsonl(records))
    preprocess([str(tmp_path / "all.jsonl")], str(tmp_path / "whole"))
    whole = [(tmp_path / f"whole_text_document.{ext}").read_bytes() for ext in ("bin", "idx")]

    shared = str(tmp_path / "shared")
    first = run_preprocess(str(tmp_path / "m1"), shared, input_uri=str(inputs), groups=3)
    assert (first["reused"], first["groups"], first["groups_tokenized"]) == (False, 3, 3)
    assert [open(f"{first['prefix']}.{ext}", "rb").read() for ext in ("bin", "idx")] == whole
    assert first["documents"] == 200 and first["source"].endswith("d.jsonl")

    again = run_preprocess(str(tmp_path / "m2"), shared, input_uri=f"file://{inputs}", groups=3)
    assert again["reused"] and again["groups_tokenized"] == 0 and again["prefix"] == first["prefix"]

    # One shard grows: a new dataset key; only its group is tokenised, the others' parts are reused.
    with open(inputs / "d.jsonl", "ab") as handle:
        handle.write(_jsonl(_records(5, start=200)))
    grown = run_preprocess(str(tmp_path / "m3"), shared, input_uri=str(inputs), groups=3)
    assert (grown["reused"], grown["groups_tokenized"]) == (False, 1)
    assert grown["dataset_key"] != first["dataset_key"] and grown["documents"] == 205
    (tmp_path / "all.jsonl").write_bytes(_jsonl(records + _records(5, start=200)))
    preprocess([str(tmp_path / "all.jsonl")], str(tmp_path / "whole2"))
    assert [open(f"{grown['prefix']}.{ext}", "rb").read() for ext in ("bin", "idx")] == [
        (tmp_path / f"whole2_text_document.{ext}").read_bytes() for ext in ("bin", "idx")]


def test_plan_splits_files_in_order_into_balanced_groups(tmp_path):
    for name, size in (("1.jsonl", 30), ("2.jsonl", 10), ("3.jsonl", 10), ("4.jsonl", 10)):
        (tmp_path / name).write_bytes(_jsonl(_records(size)))
    plan = plan_groups(str(tmp_path / "s"), input_uri=f"{tmp_path}/*.jsonl", groups=2)
    assert [[os.path.basename(p) for p in g["inputs"]] for g in plan] == [["1.jsonl"], ["2.jsonl", "3.jsonl",
                                                                                         "4.jsonl"]]
    assert {g["dataset_key"] for g in plan} == {plan[0]["dataset_key"]} and plan[0]["group_key"] != plan[1]["group_key"]
    assert [g["count"] for g in plan] == [2, 2] and all("/datasets/parts/" in g["output_prefix"] for g in plan)
    assert len(plan_groups(str(tmp_path / "s"), input_uri=str(tmp_path / "2.jsonl"), groups=8)) == 1
    assert split_in_groups([5, 5, 5, 5], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_in_groups([100, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="preprocess_groups: 0 must be at least 1"):
        plan_groups(str(tmp_path / "s"), input_uri=str(tmp_path / "2.jsonl"), groups=0)
    with pytest.raises(DataError, match="matches no file"):
        plan_groups(str(tmp_path / "s"), input_uri=f"{tmp_path}/*.parquet")


def test_merge_orders_the_collected_results_and_checks_them(tmp_path):
    for name in ("1.jsonl", "2.jsonl"):
        (tmp_path / name).write_bytes(_jsonl(_records(20)))
    shared = str(tmp_path / "s")
    plan = plan_groups(shared, input_uri=f"{tmp_path}/*.jsonl", groups=2)
    parts = [json.dumps(run_group(shared, group)) for group in plan]
    manifest = run_merge(str(tmp_path / "m"), shared, list(reversed(parts)))  # Collected order is not relied on
    assert manifest["documents"] == 40 and manifest["groups"] == 2
    with pytest.raises(ValueError, match="expected the results of groups 0..1"):
        run_merge(str(tmp_path / "m"), shared, parts[:1])


def test_input_uri_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="input_uri: 's3://bucket/x' uses scheme 's3'"):
        resolve_inputs("s3://bucket/x")
    with pytest.raises(ValueError, match=f"input_uri: {tmp_path}/missing.txt does not exist"):
        resolve_inputs(f"{tmp_path}/missing.txt")
    with pytest.raises(ValueError, match="names no file"):
        resolve_inputs(" , ")


@pytest.fixture
def kube_api(httpserver):
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = httpserver.url_for("/").rstrip("/")
    return client.CustomObjectsApi(client.ApiClient(configuration))


def _job(name, condition):
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name, "namespace": "ns"},
            "status": {"conditions": [{"type": "Created", "status": "True"}, {"type": condition, "status": "True"}]}}


def test_cleanup_deletes_running_jobs_of_the_run_and_keeps_failed_ones(httpserver, kube_api):
    base = "/apis/kubeflow.org/v1/namespaces/ns/pytorchjobs"
    httpserver.expect_request(base, method="GET").respond_with_json(
        {"items": [_job("gpt-pretrain-a", "Running"), _job("gpt-pretrain-b", "Failed")]})
    httpserver.expect_request(f"{base}/gpt-pretrain-a", method="DELETE").respond_with_json({"status": "Success"})
    lines = []
    deleted = cleanup_jobs("3f1c2b7e-run", "ns", "CANCELED", keep_failed=True, api=kube_api, log=lines.append)
    assert deleted == ["gpt-pretrain-a"]
    (listing,) = [r for r, _ in httpserver.log if r.method == "GET"]
    assert listing.args["labelSelector"] == "domino/run-id=3f1c2b7e-run"
    (delete,) = [r for r, _ in httpserver.log if r.method == "DELETE"]
    assert delete.args["propagationPolicy"] == "Background"
    assert any("keeping failed job gpt-pretrain-b" in line for line in lines)


def test_cleanup_with_nothing_left_and_a_job_already_gone(httpserver, kube_api):
    base = "/apis/kubeflow.org/v1/namespaces/ns/pytorchjobs"
    httpserver.expect_request(base, method="GET").respond_with_json({"items": [_job("gone", "Failed")]})
    httpserver.expect_request(f"{base}/gone", method="DELETE").respond_with_json({"code": 404}, status=404)
    assert cleanup_jobs("r", "ns", "FAILED", keep_failed=False, api=kube_api, log=lambda _: None) == []


def test_cleanup_of_trainjobs_reads_their_status_the_trainer_way(httpserver, kube_api):
    """job_api=trainjob: the TrainJobs' URL, a Failed TrainJob (JobSet reason) kept, a running one deleted."""
    base = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs"
    running = {"metadata": {"name": "gpt-a"}, "status": {"jobsStatus": [{"name": "node", "active": 1, "ready": 1}]}}
    failed = {"metadata": {"name": "gpt-b"}, "status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "jobset failed"}]}}
    httpserver.expect_request(base, method="GET").respond_with_json({"items": [running, failed]})
    httpserver.expect_request(f"{base}/gpt-a", method="DELETE").respond_with_json({"status": "Success"})
    lines = []
    deleted = cleanup_jobs("r", "ns", "CANCELED", keep_failed=True, api=kube_api, log=lines.append,
                           job_api="trainjob")
    assert deleted == ["gpt-a"] and "cleanup: deleted job gpt-a (state Running, pipeline CANCELED)" in lines
    assert any("keeping failed job gpt-b" in line for line in lines)
