"""A real MLflow tracking server for the tracking tests, one per session, and REST reads of what it holds.

``mlflow server`` (mlflow 3.17.2) with a sqlite backend store and proxied artifacts in a local folder
(``--artifacts-destination``: clients upload over HTTP, as they do to a team's server whose artifacts live in
object storage), on the loopback interface. MLflow's job runner (GenAI scorers, not used here) is off:
``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` (``mlflow/server/__init__.py``). The server is a process group
(``mlflow server`` forks uvicorn), stopped as a group at the end of the session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

import pytest
import requests

from distributed_helpers import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # train_helpers: run `domino pretrain`

#: Bound on the server's start (about 7 s on an idle 2-core machine; first start creates the sqlite tables).
START_TIMEOUT_S = 120


class MlflowServer:
    """A running server: its URI, and reads through MLflow's REST API (``/api/2.0/mlflow/...``)."""

    def __init__(self, uri: str, log: Path) -> None:
        self.uri, self.log = uri, log

    def get(self, endpoint: str, **params: Any) -> Dict[str, Any]:
        response = requests.get(f"{self.uri}/api/2.0/mlflow/{endpoint}", params=params, timeout=30)
        assert response.ok, f"GET {endpoint} {params}: {response.status_code} {response.text[:500]}"
        return response.json()

    def run(self, run_id: str) -> Dict[str, Any]:
        return self.get("runs/get", run_id=run_id)["run"]

    def history(self, run_id: str, key: str) -> Dict[int, float]:
        """``{step: value}`` of a metric (the last value logged at a step)."""
        points = self.get("metrics/get-history", run_id=run_id, metric_key=key, max_results=25000).get("metrics", [])
        return {int(p["step"]): float(p["value"]) for p in sorted(points, key=lambda p: p["timestamp"])}

    def params(self, run_id: str) -> Dict[str, str]:
        return {p["key"]: p["value"] for p in self.run(run_id)["data"].get("params", [])}

    def tags(self, run_id: str) -> Dict[str, str]:
        return {t["key"]: t["value"] for t in self.run(run_id)["data"].get("tags", [])}

    def artifacts(self, run_id: str) -> list:
        return [f["path"] for f in self.get("artifacts/list", run_id=run_id).get("files", [])]

    def versions(self, model: str) -> list:
        return self.get("model-versions/search", filter=f"name='{model}'").get("model_versions", [])


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> str:
    """A tokenised slice of the built-in Shakespeare corpus (GPT-2 BPE), for runs that are evaluated."""
    from domino.data.preprocess import preprocess

    out = tmp_path_factory.mktemp("corpus")
    return preprocess(None, str(out / "shakespeare"), builtin_corpus="shakespeare-small", workers=1,
                      progress=False).prefixes["text"]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> MlflowServer:
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = root / "server.log"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
               "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            assert server.poll() is None, f"mlflow server exited ({server.returncode}):\n{log.read_text()[-3000:]}"
            try:
                if requests.get(f"{uri}/health", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, f"mlflow server not up after {START_TIMEOUT_S} s:\n" \
                                                f"{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield MlflowServer(uri, log)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
