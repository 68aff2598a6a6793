"""SIGTERM through the launcher's command (the signal relay, then real torchrun): a save longer than torchrun's
shutdown timeout still completes.

torchrun (torch 2.13) forwards a SIGTERM it receives to its workers and SIGKILLs them
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds later (default 30: ``distributed/launcher/api.py`` ``LaunchConfig``,
``elastic/agent/server/api.py`` ``SimpleElasticAgent.run``, ``elastic/multiprocessing/api.py``
``SubprocessContext._close``), and an older torch ignores the variable and waits 30 s. The job's command runs
under :mod:`domino.launch.signal_relay`, which hands the pod's SIGTERM to the ranks past torchrun, so the ranks
have the grace period itself; the environment still derives the timeout from ``terminationGracePeriodSeconds``
(:func:`domino.launch.defaults.shutdown_timeout_s`) for a torchrun that receives the signal itself. The local
backend waits the grace period before its SIGKILL, as the kubelet does.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from domino.checkpoint import discovery, on_disk
from domino.launch import JobSpec, defaults
from domino.launch.local_backend import LocalLauncher
from domino.launch.pytorchjob import PyTorchJobApi
from domino.launch.render import render_job
from domino.launch.trainjob import TrainJobApi, render_trainjob

GRACE_S = 40
SLOW_SAVE_S = 6  # longer than the shutdown timeout torchrun is given below (1 s, as an old torch's fixed 30 s)

TRAIN = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--num-workers", "0", "--seed", "7",
         "--train-iters", "100000", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "0",
         "--metrics-file", "/mnt/domino/metrics.jsonl"]


def _container_env(container) -> dict:
    return {e["name"]: e["value"] for e in container["env"]}


def test_every_backend_derives_torchruns_shutdown_timeout_from_the_grace_period():
    spec = JobSpec(name="gpt", image="i", nodes=2, termination_grace_period_s=180)
    assert defaults.shutdown_timeout_s(180) == 162 and defaults.shutdown_timeout_s(30) == 25
    assert defaults.shutdown_timeout_s(3) == 1
    pod = render_job(spec, "r")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 180
    assert _container_env(pod["containers"][0])["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "162"
    trainjob = render_trainjob(spec, "r")["spec"]["trainer"]
    assert _container_env(trainjob)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "162"
    for api in (PyTorchJobApi(), TrainJobApi()):  # what the local backend gives each replica
        assert api.node_env(spec, "gpt-r", 1, 29500)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "162"
    mine = JobSpec(name="gpt", image="i", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"})
    assert PyTorchJobApi().node_env(mine, "g", 0, 1)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "100"  # --env wins


def test_a_sigterm_save_longer_than_torchruns_timeout_completes_under_the_relay(tmp_path):
    """The launcher is cancelled (SIGTERM) mid-training; it SIGTERMs the pod's first process, the relay, which
    hands it to the rank; the rank saves at the next step, and that save takes 6 s while torchrun would SIGKILL
    1 s after a SIGTERM of its own (tests/launch/test_signal_relay.py: without the relay the ranks die then)."""
    spec = JobSpec(name="term", image="i", nodes=1, nproc_per_node=1, termination_grace_period_s=GRACE_S,
                   pretrain_args=TRAIN, env={"DOMINO_FAULT_INJECT": f"slow-save:{SLOW_SAVE_S}",
                                             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1", "OMP_NUM_THREADS": "1",
                                             "DS_ACCELERATOR": "cpu"})
    metrics = tmp_path / "metrics.jsonl"
    signalled = []

    def cancel_once_training():  # like a pod deleted mid-run: SIGTERM, then the grace period
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.05)
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=cancel_once_training, daemon=True).start()
    lines = []
    result = LocalLauncher(log=lines.append).run(spec, run_id="t", workdir=str(tmp_path))
    stopped = time.monotonic()
    output = "\n".join(lines)
    assert signalled and result.reason.startswith("Interrupted: "), output[-3000:]
    assert "SIGTERM: saving at iteration" in output, output[-3000:]
    assert stopped - signalled[0] > SLOW_SAVE_S  # the save outlived torchrun's timeout
    save = tmp_path / "checkpoints" / "term-t"
    latest = on_disk.find_latest_checkpoint(save)
    assert latest is not None, output[-3000:]
    assert discovery.choose_intact(latest, strict=True).path == latest  # complete: every file at its recorded size
    saved = json.loads((latest / "checkpoint.json").read_text())["iteration"]
    logged = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]
    assert saved == logged[-1]  # saved where training stood
    assert f"saved checkpoint {latest}" in output


def test_sigterm_between_log_intervals_saves_at_the_next_step_under_a_short_shutdown_timeout(tmp_path):
    """The issue's reproduction: TP 2 under real torchrun, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT=5`` and a log interval
    far beyond the signal. Acting on SIGTERM at log intervals only, the ranks trained on until torchrun SIGKILLed
    them 5 s later and no checkpoint existed; now they save at the step after the signal and exit in time."""
    spec = JobSpec(name="step", image="i", nodes=1, nproc_per_node=2, termination_grace_period_s=15,
                   pretrain_args=[*TRAIN[:TRAIN.index("--log-interval")], "--log-interval", "1000",
                                  "--eval-iters", "0", "--eval-interval", "0", "--tensor-model-parallel-size", "2"],
                   env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    lines, signalled = [], []

    def cancel_once_training():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any("training 100000 iterations" in line for line in lines):
            time.sleep(0.05)
        time.sleep(1.0)  # some steps into the run, far from a log interval
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=cancel_once_training, daemon=True).start()
    result = LocalLauncher(log=lines.append).run(spec, run_id="t", workdir=str(tmp_path))
    output = "\n".join(lines)
    assert signalled and result.reason.startswith("Interrupted: "), output[-3000:]
    latest = on_disk.find_latest_checkpoint(tmp_path / "checkpoints" / "step-t")
    assert latest is not None, output[-3000:]
    assert discovery.choose_intact(latest, strict=True).path == latest
    saved = json.loads((latest / "checkpoint.json").read_text())["iteration"]
    assert 0 < saved < 1000, output[-3000:]  # at a step, not at a log interval
    assert "durable" in output and "s after the signal" in output, output[-3000:]
