"""Preemption end to end on the local backend (issue 26, item 4), with real processes, signals and files.

A two-pod TP=2 job is preempted as Kueue and the kubelet do it (:meth:`LocalLauncher.preempt`: SIGTERM to every
pod, the grace period, SIGKILL of what is left, the pods gone), saves within the grace, and the run is submitted
again on the one pod of two processes that is granted, with ``--parallel-layout derive``: TP=1 x DP=2. It continues
from the saved iteration with the same global batch, and its losses are those of the same-layout (TP=2)
continuation within 1e-4 relative (fp32, no dropout): the reference is the same TP=2 run never preempted, run
beside the job (a same-layout resume is exact, tests/checkpoint/test_resume.py), whose losses the preempted run
matches up to its save.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from train.train_helpers import child_env, pretrain_command, read_metrics, train_losses

from domino.checkpoint import discovery, on_disk
from domino.config.flags import ArgumentParser
from domino.launch import JobSpec, LaunchSpecError
from domino.launch.flags import add_spec_flags, spec_from_args
from domino.launch.local_backend import LocalLauncher
from domino.launch.processes import process_tree, signal_tree
from domino.launch.parallel_layout import derive_layout
from domino.launch.pretrain_args import resolve_pretrain
from domino.launch.pretrain_flags import flag_value
from domino.launch.render import render_job

GRACE_S = 60
ITERS = 24  # cheap iterations (tens of ms); the SIGTERM lands a few iterations after the second
PRETRAIN = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--num-workers", "0", "--seed", "7",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--global-batch-size", "8", "--train-iters", str(ITERS),
            "--tensor-model-parallel-size", "2", "--domino-chunks", "2"]


def _spec(nodes: int, nproc: int, metrics: str, **overrides) -> JobSpec:
    return JobSpec(name="gpt", image="registry.example/domino:test", nodes=nodes, nproc_per_node=nproc,
                   termination_grace_period_s=GRACE_S, checkpoint_dir="/mnt/domino/checkpoints/gpt",
                   pretrain_args=[*PRETRAIN, "--metrics-file", f"/mnt/domino/{metrics}"],
                   env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}, **overrides)


@pytest.fixture
def never_preempted(tmp_path):
    """The reference, started beside the test's job (one launch less on the clock): the same TP=2 run, never
    preempted; yields its process, writing ``reference.jsonl``."""
    with open(tmp_path / "reference.log", "w") as log:
        proc = subprocess.Popen(
            pretrain_command([*PRETRAIN, "--metrics-file", str(tmp_path / "reference.jsonl")], nproc=2),
            env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    yield proc
    signal_tree(process_tree(proc.pid), signal.SIGKILL)  # ended already unless the test failed
    proc.wait()


@pytest.mark.timeout(900)  # three short 2-process runs (two at once); minutes only on a heavily shared machine
def test_preempted_tp2_job_saves_in_the_grace_and_continues_on_one_pod_at_dp2(tmp_path, never_preempted):
    metrics = tmp_path / "preempted.jsonl"
    lines: list = []
    launcher = LocalLauncher(log=lines.append)
    trees, preempted_at = {}, []

    def preempt_once_training():  # Kueue evicts the workload a few iterations in
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.02)
        trees.update({name: process_tree(proc.pid) for name, proc in launcher.processes.items()})
        preempted_at.append(time.monotonic())
        launcher.preempt()

    threading.Thread(target=preempt_once_training, daemon=True).start()
    result = launcher.run(_spec(2, 1, "preempted.jsonl"), run_id="p", workdir=str(tmp_path), timeout_s=600)
    output = "\n".join(lines)
    assert result.phase == "Suspended" and result.reason.startswith("Preempted: "), result.describe() + output[-3000:]
    assert "every pod exited within it" in result.reason, result.reason  # saved within the grace, no SIGKILL
    assert preempted_at and time.monotonic() - preempted_at[0] < GRACE_S  # the pods went within the grace
    assert len(trees) == 2 and all(len(tree) >= 2 for tree in trees.values())  # torchrun and its rank, per pod
    for pid in (pid for tree in trees.values() for pid in tree):  # the pods are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "SIGTERM: saving at iteration" in output, output[-3000:]
    ckpt_dir = tmp_path / "checkpoints" / "gpt"
    saved = on_disk.find_latest_checkpoint(ckpt_dir)
    assert saved is not None and discovery.choose_intact(saved, strict=True).path == saved  # complete, verified
    iteration = on_disk.read_checkpoint_meta(saved)["iteration"]
    assert iteration == read_metrics(metrics)[-1]["iteration"] < ITERS  # saved where training stood, mid-run

    # Re-admitted on one pod of two processes: the launcher derives TP=1 x DP=2 for it.
    lines.clear()
    result = LocalLauncher(log=lines.append).run(_spec(1, 2, "continued.jsonl", parallel_layout="derive"),
                                                 run_id="p", workdir=str(tmp_path), timeout_s=600)
    output = "\n".join(lines)
    assert result.succeeded, result.describe() + output[-3000:]
    assert "parallel layout derived for 1 pod(s) x 2 process(es): TP 1 x DP 2" in output
    assert re.search(r"global batch 8 \(micro \d+ x DP 2 x accumulation \d+\), TP 1,", output), output[-3000:]
    assert f"resumed from {saved} at iteration {iteration}" in output, output[-3000:]
    assert never_preempted.wait(timeout=600) == 0, (tmp_path / "reference.log").read_text()[-4000:]
    reference = train_losses(tmp_path / "reference.jsonl")
    assert all(abs(reference[r["iteration"]] - r["lm_loss"]) <= 1e-6 * abs(r["lm_loss"])
               for r in read_metrics(metrics))  # the preempted run is the reference up to the save
    continued = read_metrics(tmp_path / "continued.jsonl")
    assert [r["iteration"] for r in continued] == list(range(iteration + 1, ITERS + 1))
    assert all(r["consumed_samples"] == 8 * r["iteration"] for r in continued)  # the same global batch
    assert sorted(reference) == list(range(1, ITERS + 1))
    for record in continued:
        expected = reference[record["iteration"]]
        assert abs(record["lm_loss"] - expected) <= 1e-4 * abs(expected), (record, expected)


BIG = ["--preset", "gpt3-1.3b", "--mock-data", "--train-iters", "10"]


def _derive(nodes=1, nproc=2, args=PRETRAIN, **overrides) -> JobSpec:
    return JobSpec(name="gpt", image="i", nodes=nodes, nproc_per_node=nproc, pretrain_args=list(args),
                   parallel_layout="derive", **overrides)


def container_command_of(spec: JobSpec) -> list:
    container = render_job(spec, "r")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    return container["command"] + container.get("args", [])


def test_derive_keeps_tp_within_a_pod_smallest_that_fits_and_refuses_in_one_line():
    # CPU pods: the smallest TP the model admits; the job's command carries it after the run's own TP (the last
    # of a repeated flag wins in argparse).
    one_pod = _derive()
    assert derive_layout(one_pod).tensor_model_parallel_size == 1
    assert flag_value(container_command_of(one_pod), "--tensor-model-parallel-size") == "1"
    assert flag_value(container_command_of(JobSpec(name="gpt", image="i", nproc_per_node=2, pretrain_args=PRETRAIN)),
                      "--tensor-model-parallel-size") == "2"  # given: the run's own
    # A size the run's other settings refuse is passed over, saying why; a given pipeline size is kept.
    pipeline = [*PRETRAIN, "--pipeline-model-parallel-size", "2"]
    assert derive_layout(_derive(nodes=2, args=pipeline)).why.startswith(
        "2 pod(s) x 2 process(es): TP 2 x PP 2 x DP 1 (TP 1: --global-batch-size 8 gives 1 micro-batches")
    # GPU pods: the smallest TP within the 8 GPUs of a pod whose memory estimate fits (domino estimate).
    gpus = dict(nodes=2, nproc=8, args=BIG, gpus_per_node=8)
    assert derive_layout(_derive(**gpus, gpu_memory_gb=24.0)).why.startswith("2 pod(s) x 8 process(es): TP 4 x DP 4")
    assert derive_layout(_derive(**gpus, gpu_memory_gb=80.0)).tensor_model_parallel_size == 1
    with pytest.raises(LaunchSpecError, match=r"^--parallel-layout derive: 2 pod\(s\) x 8 process\(es\) cannot hold "
                       r"this run: TP 1: the estimate is [\d.]+ GiB per GPU, over 90% of 8 GiB .*; TP 8: "):
        derive_layout(_derive(**gpus, gpu_memory_gb=8.0))
    # A given --tensor-model-parallel-size is the largest allowed: where its weights fit and the sequence's
    # activations do not, context parallelism takes the rest (tests/launch/test_derive_context_parallel.py).
    assert derive_layout(_derive(**{**gpus, "args": [*BIG, "--tensor-model-parallel-size", "2"]},
                                 gpu_memory_gb=24.0)).why.startswith(
        "2 pod(s) x 8 process(es): TP 2 x CP 2 x DP 4 (TP 1: the estimate is 39.3 GiB per GPU, over 90% of 24 GiB "
        "(domino estimate); TP 2: the estimate is 23.9 GiB per GPU, over 90% of 24 GiB (domino estimate); TP 1 x CP 2")
    with pytest.raises(LaunchSpecError, match="^--parallel-layout derive on GPU pods needs --gpu-memory-gb"):
        derive_layout(_derive(**gpus))
    with pytest.raises(LaunchSpecError, match="^--parallel-layout derive: --nproc-per-node auto says nothing"):
        derive_layout(_derive(nproc="auto"))
    with pytest.raises(LaunchSpecError, match="TP 1: one of --train-iters or --train-samples is required"):
        derive_layout(_derive(args=["--preset", "tiny", "--mock-data"]))
    # Before anything is created: a TP of 8 on two processes is refused as given, and derived to fit.
    eight = [*PRETRAIN, "--tensor-model-parallel-size", "8"]
    with pytest.raises(LaunchSpecError, match=r"world size 2\): .*tensor-model-parallel-size 8"):
        resolve_pretrain(JobSpec(name="gpt", image="i", nproc_per_node=2, pretrain_args=eight))
    resolve_pretrain(_derive(args=eight))
    # The flag, and its validation in one place.
    parser = ArgumentParser()
    add_spec_flags(parser)
    assert spec_from_args(parser.parse_args(["--name", "gpt", "--parallel-layout", "derive"])).parallel_layout == "derive"
    with pytest.raises(LaunchSpecError, match="--parallel-layout: 'auto' is not one of given, derive"):
        JobSpec(name="gpt", image="i", parallel_layout="auto").validate()


def test_the_pipeline_pretrain_step_passes_the_layout_option_to_the_job():
    from components.declare import settings_from_values
    from components.layout import RunLayout
    from components.pretrain.step import PretrainSettings, job_spec, pretrain_argv
    from pipelines.params import ParamError, check_params, check_training_config

    values = {"tensor_model_parallel_size": 8, "nodes": 1, "nproc_per_node": 2, "train_iters": 4}
    with pytest.raises(ParamError, match="tensor-model-parallel-size 8"):  # given: 8 does not divide 2 processes
        check_training_config(values)
    check_training_config({**values, "parallel_layout": "derive"})  # derive: TP 8 is only the largest allowed
    with pytest.raises(ParamError, match="--param parallel_layout=auto: expected one of given, derive"):
        check_params({"parallel_layout": "auto"})
    settings = settings_from_values(PretrainSettings, {**values, "parallel_layout": "derive", "run_id": "r",
                                                       "shared_root": "/mnt/domino"})
    spec = job_spec(settings, pretrain_argv(settings, "/mnt/domino/data/x", RunLayout("/mnt/domino", "r")))
    assert spec.parallel_layout == "derive" and derive_layout(spec).tensor_model_parallel_size == 1
