"""``domino pipeline submit|schedule|schedules`` against a local HTTP server speaking KFP's v2beta1 REST API.

The server (pytest-httpserver) answers the few endpoints ``kfp.Client`` calls; the tests assert what the
client sent: the compiled pipeline, the parameters, the cron schedule, concurrency and catch-up.
"""

import json
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from domino.cli.main import main
from pipelines import COMPILED_PATH

API = "/apis/v2beta1"


def _run_cli(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


@pytest.fixture
def kfp_server(httpserver, monkeypatch, tmp_path):
    """A fake KFP API: healthz, experiments (none exist yet), runs, recurring runs."""
    monkeypatch.setenv("HOME", str(tmp_path))  # kfp.Client reads ~/.config/kfp/context.json
    monkeypatch.delenv("DOMINO_IMAGE_REPOSITORY", raising=False)
    httpserver.expect_request(f"{API}/healthz", method="GET").respond_with_json({"multi_user": False})
    httpserver.expect_request(f"{API}/experiments", method="GET").respond_with_json({"experiments": []})
    httpserver.expect_request(f"{API}/experiments", method="POST").respond_with_json(
        {"experiment_id": "exp-1", "display_name": "domino"})
    httpserver.expect_request(f"{API}/runs", method="POST").respond_with_json(
        {"run_id": "run-1", "experiment_id": "exp-1", "display_name": "nightly"})
    httpserver.expect_request(f"{API}/recurringruns", method="POST").respond_with_json(
        {"recurring_run_id": "rr-1", "display_name": "weekly"})
    httpserver.expect_request(f"{API}/recurringruns", method="GET").respond_with_json({
        "recurringRuns": [  # the server (grpc-gateway) uses this spelling for the list
            {"recurring_run_id": "rr-1", "display_name": "weekly", "status": "ENABLED", "max_concurrency": "1",
             "no_catchup": True, "trigger": {"cron_schedule": {"cron": "0 0 3 * * 0"}}},
            {"recurring_run_id": "rr-2", "display_name": "hourly", "status": "DISABLED", "max_concurrency": "1",
             "trigger": {"periodic_schedule": {"interval_second": "3600"}}},
        ]})
    httpserver.expect_request(f"{API}/recurringruns/rr-1", method="DELETE").respond_with_json({})
    return httpserver


def _requests(server, method, path):
    return [request for request, _ in server.log if request.method == method and request.path == path]


def _committed_pipeline():
    with open(COMPILED_PATH, encoding="utf-8") as handle:
        docs = list(yaml.safe_load_all(handle))
    return docs


def test_submit_sends_the_pipeline_and_typed_parameters(kfp_server, capsys):
    code = _run_cli(["pipeline", "submit", "--host", kfp_server.url_for("/"), "--namespace", "team-a",
                     "--experiment", "domino", "--run-name", "nightly", "--param", "train_iters=50",
                     "--param", "warm_start=true", "--param", "lr=0.001", "--param", "preset=tiny"])
    assert code == 0
    assert "submitted run run-1" in capsys.readouterr().out
    # The experiment was looked up by name in the namespace, then created.
    (lookup,) = _requests(kfp_server, "GET", f"{API}/experiments")
    query = parse_qs(urlparse(lookup.url).query)
    assert query["namespace"] == ["team-a"]
    assert json.loads(query["filter"][0])["predicates"][0]["stringValue"] == "domino"
    (created,) = _requests(kfp_server, "POST", f"{API}/experiments")
    assert created.get_json() == {"display_name": "domino", "namespace": "team-a"}
    (run,) = _requests(kfp_server, "POST", f"{API}/runs")
    body = run.get_json()
    assert body["display_name"] == "nightly" and body["experiment_id"] == "exp-1"
    assert body["runtime_config"]["parameters"] == {
        "train_iters": 50, "warm_start": True, "lr": 0.001, "preset": "tiny", "namespace": "team-a"}
    pipeline_spec, platform_spec = _committed_pipeline()
    assert body["pipeline_spec"]["pipeline_spec"]["pipelineInfo"] == pipeline_spec["pipelineInfo"]
    assert body["pipeline_spec"]["pipeline_spec"]["root"] == pipeline_spec["root"]
    assert body["pipeline_spec"]["platform_spec"] == platform_spec


def test_explicit_job_namespace_wins_over_the_profile_namespace(kfp_server):
    code = _run_cli(["pipeline", "submit", "--host", kfp_server.url_for("/"), "--namespace", "team-a",
                     "--param", "namespace=training"])
    assert code == 0
    (run,) = _requests(kfp_server, "POST", f"{API}/runs")
    assert run.get_json()["runtime_config"]["parameters"] == {"namespace": "training"}


def test_schedule_creates_a_recurring_run_without_overlap_or_catch_up(kfp_server, capsys):
    code = _run_cli(["pipeline", "schedule", "--host", kfp_server.url_for("/"), "--namespace", "team-a",
                     "--cron", "0 0 3 * * 0", "--name", "weekly", "--param", "warm_start=true"])
    assert code == 0
    assert "created recurring run rr-1" in capsys.readouterr().out
    (request,) = _requests(kfp_server, "POST", f"{API}/recurringruns")
    body = request.get_json()
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * 0"}}
    assert int(body["max_concurrency"]) == 1
    assert body["no_catchup"] is True
    assert body["mode"] == "ENABLE"
    assert body["display_name"] == "weekly" and body["experiment_id"] == "exp-1"
    assert body["runtime_config"]["parameters"] == {"warm_start": True, "namespace": "team-a"}
    assert body["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "gpt-pretrain"


@pytest.mark.parametrize("cron, message", [
    ("0 3 * * 0", "has 5 fields; Kubeflow Pipelines needs 6 with seconds first, e.g. '0 0 3 * * 0'"),
    ("0 0 25 * * 0", "hour value '25' is outside 0-23"),
    ("0 0 3 * * MONDAY", "day of week value 'MONDAY'"),
    ("0 0 3 ? * 0 2026", "has 7 fields"),
])
def test_bad_cron_is_rejected_before_anything_is_sent(kfp_server, capsys, cron, message):
    code = _run_cli(["pipeline", "schedule", "--host", kfp_server.url_for("/"), "--cron", cron])
    assert code == 2
    assert message in capsys.readouterr().err
    assert kfp_server.log == []


def test_bad_param_is_rejected_before_anything_is_sent(kfp_server, capsys):
    code = _run_cli(["pipeline", "submit", "--host", kfp_server.url_for("/"), "--param", "tensor_model_paralel_size=2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--param tensor_model_paralel_size: the pipeline has no such parameter; did you mean tensor_model_parallel_size" in err
    code = _run_cli(["pipeline", "submit", "--host", kfp_server.url_for("/"), "--param", "warm_start=maybe"])
    assert code == 2
    assert "--param warm_start=maybe: expected true or false" in capsys.readouterr().err
    assert kfp_server.log == []


def test_schedules_list_and_delete(kfp_server, capsys):
    code = _run_cli(["pipeline", "schedules", "list", "--host", kfp_server.url_for("/"), "--namespace", "team-a",
                     "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["schedule"], r["status"]) for r in rows] == [
        ("rr-1", "0 0 3 * * 0", "ENABLED"), ("rr-2", "every 3600s", "DISABLED")]
    (listing,) = _requests(kfp_server, "GET", f"{API}/recurringruns")
    assert parse_qs(urlparse(listing.url).query)["namespace"] == ["team-a"]
    code = _run_cli(["pipeline", "schedules", "delete", "--host", kfp_server.url_for("/"), "rr-1"])
    assert code == 0
    assert "deleted recurring run rr-1" in capsys.readouterr().out
    assert len(_requests(kfp_server, "DELETE", f"{API}/recurringruns/rr-1")) == 1


def test_submit_without_namespace_asks_healthz(kfp_server):
    code = _run_cli(["pipeline", "submit", "--host", kfp_server.url_for("/")])
    assert code == 0
    assert len(_requests(kfp_server, "GET", f"{API}/healthz")) == 1
    (run,) = _requests(kfp_server, "POST", f"{API}/runs")
    assert run.get_json()["runtime_config"]["parameters"] == {}
