"""The preprocess step on a real corpus, its input checks, and the exit handler against a fake Kubernetes API."""

import hashlib
import json

import pytest

from components.cleanup.step import cleanup_jobs
from components.preprocess.step import resolve_inputs, run_preprocess
from domino.data.indexed_dataset import IndexedDataset


def test_preprocess_builtin_corpus_writes_dataset_and_manifest(tmp_path):
    manifest_path = str(tmp_path / "artifact" / "dataset")
    manifest = run_preprocess(manifest_path, str(tmp_path / "shared"), "run-1", corpus="shakespeare-small")
    with open(manifest_path) as handle:
        assert json.load(handle) == manifest
    prefix = manifest["prefix"]
    assert prefix == str(tmp_path / "shared" / "runs" / "run-1" / "data" / "corpus_text_document")
    with open(prefix + ".idx", "rb") as handle:
        assert hashlib.sha256(handle.read()).hexdigest() == manifest["idx_sha256"]
    dataset = IndexedDataset(prefix)
    assert len(dataset) == manifest["documents"] > 10
    assert sum(len(dataset[i]) for i in range(len(dataset))) == manifest["tokens"]
    assert manifest["vocab_size"] == 50257 and manifest["tokenizer"] == "gpt2"
    assert manifest["source"] == "builtin:shakespeare-small"


def test_preprocess_files_given_by_uri(tmp_path):
    text = tmp_path / "in.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"document number {i} " * 5}) for i in range(20)) + "\n")
    manifest = run_preprocess(str(tmp_path / "m"), str(tmp_path / "s"), "r", input_uri=f"file://{text}")
    assert manifest["documents"] == 20 and manifest["source"] == str(text)


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
