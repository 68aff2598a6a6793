"""What MLflow tracking costs `domino pretrain`, with the server up, stopped, and hanging.

Runs the same short single-process training (tiny preset, mock data, a metrics record every iteration) with
``MLFLOW_TRACKING_URI`` unset, pointed at a live ``mlflow server`` (sqlite, loopback), at a port where nothing
listens (a stopped server: connection refused), and at a socket that accepts connections and never answers (a
hung server: every request waits for ``MLFLOW_HTTP_REQUEST_TIMEOUT``). Prints wall time per case, its extra
time over the untracked run, and the MLflow lines the run printed.

    python benchmarks/tracking_overhead.py [--iters 40] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

TRAIN = ["--preset", "tiny", "--mock-data", "--vocab-size", "512", "--num-workers", "0", "--seed", "7",
         "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(root: Path) -> subprocess.Popen:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    proc.uri = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{proc.uri}/health", timeout=2):  # type: ignore[attr-defined]
                return proc
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("mlflow server did not start within 120 s")


def _train(iters: int, folder: Path, uri: Optional[str]) -> Dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RANK", "WORLD_SIZE")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    if uri:
        env["MLFLOW_TRACKING_URI"] = uri
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "domino", "pretrain", *TRAIN, "--train-iters", str(iters),
                           "--metrics-file", str(folder / "metrics.jsonl"), "--save", str(folder / "ckpt")],
                          env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"domino pretrain failed:\n{proc.stderr[-3000:]}")
    said = [line.split(": ", 1)[-1] for line in proc.stderr.splitlines() if "MLflow" in line]
    return {"seconds": round(seconds, 1), "mlflow_lines": said}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = _start_server(root / "server")
        hung = socket.socket()
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)  # accepts (the kernel completes the handshake), never reads or answers
        cases = {"no tracking": None, "server up": server.uri, "server stopped": f"http://127.0.0.1:{_free_port()}",
                 "server hung": f"http://127.0.0.1:{hung.getsockname()[1]}"}
        results: Dict[str, List[Dict[str, object]]] = {name: [] for name in cases}
        try:
            for repeat in range(args.repeats):  # alternate the cases so load drifts hit them alike
                for name, uri in cases.items():
                    folder = root / f"{name.replace(' ', '-')}-{repeat}"
                    folder.mkdir()
                    results[name].append(_train(args.iters, folder, uri))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
            hung.close()
    base = min(r["seconds"] for r in results["no tracking"])
    if args.json:
        print(json.dumps({"iters": args.iters, "results": results}, indent=2))
        return 0
    print(f"domino pretrain, tiny preset, {args.iters} iterations, a record per iteration; best of {args.repeats}")
    print(f"{'case':<16} {'wall s':>8} {'extra s':>8}  MLflow lines (first run)")
    for name, runs in results.items():
        best = min(r["seconds"] for r in runs)
        said = " | ".join(runs[0]["mlflow_lines"])[:150] or "-"
        print(f"{name:<16} {best:>8.1f} {best - base:>+8.1f}  {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
