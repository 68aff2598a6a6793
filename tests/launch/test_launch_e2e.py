"""End to end: the rendered pretrain job, run by the local backend, trains TP=2 across two replicas on
the built-in corpus, and a retry of the same run resumes from the checkpoint on the "PVC"."""

from __future__ import annotations

import re

from domino.launch import JobSpec, run_job
from domino.launch.render import render_job
from k8s_schemas import validate_job

PRETRAIN = ["--preset", "tiny", "--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--num-workers", "0",
            "--log-interval", "1", "--eval-iters", "0", "--seed", "7",
            "--data-path", "/mnt/domino/data/shakespeare_text_document"]


def test_pretrain_tp2_across_two_replicas_then_resume(tmp_path):
    from domino.data.preprocess import preprocess

    preprocess(None, str(tmp_path / "data" / "shakespeare"), builtin_corpus="shakespeare-small", workers=1,
               progress=False)
    spec = JobSpec(name="gpt-e2e", image="registry.example/domino:test", nodes=2, nproc_per_node=1,
                   pretrain_args=[*PRETRAIN, "--train-iters", "4"], env={"OMP_NUM_THREADS": "1"})
    job = render_job(spec, "e2e")
    validate_job(job)
    command = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert command[:9] == ["python", "-m", "domino.launch.signal_relay", "--grace-period-s", "180", "torchrun", "-m",
                           "domino", "pretrain"]

    lines = []
    result = run_job(spec, "local", run_id="e2e", workdir=str(tmp_path), log=lines.append, timeout_s=240)
    assert result.succeeded, result.describe(60)
    text = "\n".join(lines)
    assert "world_size=2" in text and "TP 2" in text and "Domino chunks 2" in text
    assert re.search(r"iteration\s+4/4", text)
    assert (tmp_path / "checkpoints" / "gpt-e2e-e2e" / "iter_0000004").is_dir()

    # A retry of the same run (same name, same --load/--save on the volume) continues where it stopped.
    # Two iterations more than the first run's schedule: its longer decay taken on purpose.
    spec.pretrain_args = [*PRETRAIN, "--train-iters", "6", "--override-opt_param-scheduler"]
    lines.clear()
    result = run_job(spec, "local", run_id="e2e", workdir=str(tmp_path), log=lines.append, timeout_s=240)
    assert result.succeeded, result.describe(60)
    text = "\n".join(lines)
    assert re.search(r"resumed from .*iter_0000004 at iteration 4", text), text[-3000:]
    assert re.search(r"iteration\s+6/6", text) and not re.search(r"iteration\s+1/6", text)
