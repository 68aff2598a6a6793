"""docs/cluster.md "Cold start": every pod of both APIs carries torchrun's rendezvous timeout
(``PET_RDZV_CONF=timeout=<--start-timeout>``), torchrun really reads it (a real torchrun, node 0 of a 2-node
static rendezvous whose second node never comes, gives up after the configured seconds instead of torch's
600), and the Master gets no readiness probe (its DNS name must resolve as soon as it runs: the operator's
headless Service has no publishNotReadyAddresses)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from domino.cli.main import main as domino_main
from domino.launch import JobSpec, LaunchSpecError, defaults, trainjob
from domino.launch.render import render_job
from domino.launch.spec import DEFAULT_START_TIMEOUT_S


def _env(entries):
    return {e["name"]: e.get("value") for e in entries}


def test_both_apis_give_every_pod_the_rendezvous_timeout_and_the_master_no_readiness_probe():
    spec = JobSpec(name="gpt", image="i", nodes=4, gpus_per_node=8, nproc_per_node=8)
    assert spec.start_timeout_s == DEFAULT_START_TIMEOUT_S == 1200
    job = render_job(spec, "r")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert _env(container["env"])[defaults.RDZV_CONF_ENV] == "timeout=1200"
        assert "readinessProbe" not in container and "startupProbe" not in container
    tj = trainjob.render_trainjob(JobSpec(name="gpt", image="i", nodes=4, start_timeout_s=1800), "r")
    assert _env(tj["spec"]["trainer"]["env"])[defaults.RDZV_CONF_ENV] == "timeout=1800"
    # --env wins, as for every default of the environment.
    own = render_job(JobSpec(name="gpt", image="i", env={defaults.RDZV_CONF_ENV: "timeout=60"}), "r")
    master = own["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert _env(master["env"])[defaults.RDZV_CONF_ENV] == "timeout=60"


def test_start_timeout_flag_and_its_refusal(capsys):
    with pytest.raises(SystemExit) as exit_info:
        domino_main(["launch", "render", "--name", "gpt", "--image", "i", "--start-timeout", "2400", "--",
                     "--preset", "tiny", "--mock-data", "--train-iters", "2"])
    assert exit_info.value.code == 0
    assert "value: timeout=2400" in capsys.readouterr().out
    with pytest.raises(LaunchSpecError, match="--start-timeout: must be an integer >= 1"):
        JobSpec(name="gpt", image="i", start_timeout_s=0).validate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_reads_the_timeout_from_the_environment(tmp_path):
    """Node 0 of two under torchrun's static rendezvous, the second node absent (still pulling its image):
    with PET_RDZV_CONF=timeout=3 torchrun gives up after about 3 s, so the variable is what bounds the wait."""
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the rendezvous should not complete')\n")
    env = {**os.environ, "PET_RDZV_CONF": "timeout=3", "PET_NNODES": "2", "PET_NODE_RANK": "0",
           "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(_free_port())}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", str(script)], env=env, capture_output=True,
                          text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert "the rendezvous should not complete" not in done.stderr
    assert "timeout" in done.stderr.lower() or "timed out" in done.stderr.lower(), done.stderr[-2000:]
    assert elapsed < 60, elapsed  # torch's own default would have waited 600 s
