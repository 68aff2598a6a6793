"""Faults on one rank of a real torchrun job end the same way on every rank: one line, no traceback, no hang.

* rank 1 reads a damaged copy of the dataset: both ranks stop with the error naming rank 1 and the file;
* rank 1's disk is full while saving (``RLIMIT_FSIZE``): both ranks stop, the previous checkpoint and
  ``latest`` are untouched, no temporary directory is left behind;
* one node of a two-node launch is SIGKILLed during training: the survivor reports the lost rank and its
  node, the last iteration and the checkpoint a restart resumes from, and exits within 60 s; a restart of
  both nodes resumes from that checkpoint.

Each rank's output is read from torchrun's per-rank log files (``--log-dir`` with ``--redirects 3``, torch
``distributed/run.py``), so torchrun's own summary of the failed workers is not mistaken for a rank's.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from distributed_helpers import free_port
from train_helpers import TINY, child_env, read_metrics, train_losses

WRAPPER = str(Path(__file__).with_name("rank_faults.py"))
MOCK = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--eval-iters", "0", "--eval-interval", "0"]


def _torchrun(args: List[str], log_dir: Path, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
              port: int = 0) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()),
            "--log-dir", str(log_dir), "--redirects", "3", WRAPPER, "pretrain", *args]


def _rank_stderr(log_dir: Path) -> Dict[int, str]:
    """{local rank: its stderr} from torchrun's ``<log-dir>/<run>/attempt_0/<local rank>/stderr.log``."""
    return {int(p.parent.name): p.read_text() for p in Path(log_dir).rglob("stderr.log")}


def _error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("domino pretrain: error: ")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def _run(args, log_dir, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(_torchrun(args, log_dir), env=child_env(env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(600)
def test_dataset_damaged_on_one_rank_stops_every_rank_with_the_same_line(tmp_path, corpus_prefix):
    for node in ("good", "bad"):
        (tmp_path / node / "data").mkdir(parents=True)
        for ext in (".bin", ".idx"):
            shutil.copy(corpus_prefix + ext, tmp_path / node / "data" / f"corpus{ext}")
    with open(tmp_path / "bad" / "data" / "corpus.idx", "r+b") as handle:
        handle.truncate(40)
    args = [*TINY, "--data-path", "data/corpus", "--train-iters", "2", "--eval-iters", "0", "--eval-interval", "0"]
    proc = _run(args, tmp_path / "logs", {"DOMINO_TEST_CWD_RANK0": str(tmp_path / "good"),
                                          "DOMINO_TEST_CWD_RANK1": str(tmp_path / "bad")})
    assert proc.returncode != 0
    logs = _rank_stderr(tmp_path / "logs")
    lines = {rank: _error_line(text) for rank, text in logs.items()}
    assert sorted(lines) == [0, 1] and lines[0] == lines[1]
    assert f"rank 1 (node {socket.gethostname()}) failed while building the datasets" in lines[0]
    assert "corpus.idx" in lines[0] and "rank 0 " not in lines[0]
    assert all("Traceback" not in text for text in logs.values())


@pytest.mark.timeout(600)
def test_disk_full_on_one_rank_during_a_save_leaves_the_previous_checkpoint_and_latest(tmp_path):
    from domino.checkpoint import manifest

    save = tmp_path / "ckpt"
    args = [*MOCK, "--save", str(save), "--load", str(save), "--save-interval", "2"]
    first = _run([*args, "--train-iters", "2"], tmp_path / "logs1", {})
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.relative_to(save): p.read_bytes() for p in (save / "iter_0000002").rglob("*") if p.is_file()}
    # Rank 1's file of the optimizer state (DCP names it shard-00002-...): half of it fits.
    limit = next((save / "iter_0000002" / "optimizer").glob("shard-00002-*")).stat().st_size // 2

    full = _run([*args, "--train-iters", "4", "--override-opt_param-scheduler"], tmp_path / "logs2",
                {"DOMINO_TEST_FSIZE_RANK1": str(limit)})  # a longer run than the first: its decay taken on purpose
    assert full.returncode != 0
    logs = _rank_stderr(tmp_path / "logs2")
    lines = {rank: _error_line(text) for rank, text in logs.items()}
    assert lines[0] == lines[1]
    assert "rank 1 (node " in lines[0] and "failed while saving checkpoint iter_0000004" in lines[0]
    assert "File too large" in lines[0] and "(optimizer state)" in lines[0] and "rank 0 (node " not in lines[0]
    assert f"`latest` in {save} names iter_0000002: a restart resumes from it" in lines[0]
    assert all("Traceback" not in text for text in logs.values())
    assert (save / "latest").read_text().strip() == "iter_0000002"
    # No torn or temporary directories; the lock file of domino/checkpoint/save_root.py and its record stay.
    assert sorted(p.name for p in save.iterdir()) == [".save.lock", ".save.lock.json", "goodput.jsonl", "iter_0000002",
                                                      "latest"]
    after = {p.relative_to(save): p.read_bytes() for p in (save / "iter_0000002").rglob("*") if p.is_file()}
    assert after == before and manifest.find_damage(save / "iter_0000002") is None


def _kill_tree(pid: int) -> None:
    from domino.launch.processes import process_tree

    for member in process_tree(pid):  # torchrun starts its worker in a session of its own: kill both
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_iteration(metrics: Path, iteration: int, node0: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and any(r.get("iteration", 0) >= iteration for r in read_metrics(metrics)[:-1]):
            return
        assert node0.poll() is None, "node 0 ended before the kill"
        time.sleep(0.2)
    raise AssertionError(f"iteration {iteration} not reached")


def _start_nodes(args: List[str], tmp_path: Path, attempt: str) -> List[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen(_torchrun(args, tmp_path / f"{attempt}-node{n}", nproc=1, nnodes=2, node_rank=n,
                                       port=port), env=child_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True) for n in (0, 1)]


@pytest.mark.timeout(900)
def test_a_node_killed_in_training_is_reported_by_the_survivor_and_a_restart_resumes(tmp_path):
    save = tmp_path / "ckpt"
    args = [*MOCK, "--train-iters", "100000", "--save-interval", "3", "--keep-last", "2", "--save", str(save),
            "--load", str(save), "--metrics-file", str(tmp_path / "killed.jsonl")]
    node0, node1 = _start_nodes(args, tmp_path, "killed")
    try:
        _wait_for_iteration(tmp_path / "killed.jsonl", 7, node0)
        _kill_tree(node1.pid)
        killed_at = time.monotonic()
        node0.wait(timeout=60)  # the survivor (and its torchrun) exit within 60 s
        assert time.monotonic() - killed_at < 60
    finally:
        for node in (node0, node1):
            if node.poll() is None:
                _kill_tree(node.pid)
    node1.wait()
    assert node0.returncode != 0
    survivor = _rank_stderr(tmp_path / "killed-node0")[0]
    line = _error_line(survivor)
    last = max(train_losses(tmp_path / "killed.jsonl"))
    latest = (save / "latest").read_text().strip()
    assert f"lost rank 1 (node {socket.gethostname()}) during training after iteration " in line
    assert int(line.split("after iteration ")[1].split()[0]) in (last, last + 1)  # rank 0 may be one step ahead
    assert f"`latest` in {save} names {latest}: a restart resumes from it" in line
    assert "Traceback" not in survivor

    resumed_args = [*args[:-1], str(tmp_path / "resumed.jsonl"), "--exit-interval", str(int(latest[5:]) + 2)]
    nodes = _start_nodes(resumed_args, tmp_path, "resumed")
    assert [node.wait(timeout=300) for node in nodes] == [0, 0]
    assert sorted(train_losses(tmp_path / "resumed.jsonl")) == [int(latest[5:]) + 1, int(latest[5:]) + 2]
