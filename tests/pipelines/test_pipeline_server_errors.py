"""Server trouble is one clear line and exit status 1, not a traceback."""

import subprocess
import sys

from pytest_httpserver import HTTPServer

from distributed_helpers import free_port


def _domino(*args):
    return subprocess.run([sys.executable, "-m", "domino", *args], capture_output=True, text=True, timeout=120)


def test_unreachable_server_is_named():
    host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = _domino("pipeline", "schedules", "list", "--host", host)
    assert proc.returncode == 1
    assert f"cannot reach Kubeflow Pipelines at {host}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_server_refusal_is_reported_with_status(httpserver: HTTPServer):
    httpserver.expect_request("/apis/v2beta1/healthz").respond_with_json({"multi_user": False})
    httpserver.expect_request("/apis/v2beta1/recurringruns").respond_with_data("forbidden by policy", status=403)
    proc = _domino("pipeline", "schedules", "list", "--host", httpserver.url_for("").rstrip("/"))
    assert proc.returncode == 1
    assert "answered 403" in proc.stderr and "forbidden by policy" in proc.stderr
    assert "Traceback" not in proc.stderr
