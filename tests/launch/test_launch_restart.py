"""A pod lost mid-training: the local backend restarts replicas as the operator and kubelet would
(OnFailure: in place, counted against backoffLimit) and training resumes from the last checkpoint on
the shared volume to completion. Real processes, a real SIGKILL of the whole "pod" (process group)."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from domino.launch import JobSpec
from domino.launch.local_backend import LocalLauncher
from domino.launch.processes import process_tree

PRETRAIN = ["--preset", "tiny", "--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--num-workers", "0",
            "--log-interval", "1", "--eval-iters", "0", "--seed", "7", "--train-iters", "8", "--save-interval", "2",
            "--data-path", "/mnt/domino/data/shakespeare_text_document"]


@pytest.mark.timeout(1800)  # two starts of a 2-rank job; minutes only on a heavily shared machine
def test_one_pod_killed_restarts_and_resumes_from_the_checkpoint_to_completion(tmp_path):
    from domino.data.preprocess import preprocess

    preprocess(None, str(tmp_path / "data" / "shakespeare"), builtin_corpus="shakespeare-small", workers=1,
               progress=False)
    spec = JobSpec(name="gpt-loss", image="registry.example/domino:test", nodes=2, nproc_per_node=1,
                   pretrain_args=PRETRAIN, env={"OMP_NUM_THREADS": "1"})
    lines = []
    launcher = LocalLauncher(log=lines.append, restart_delay_s=1.0)
    ckpt = tmp_path / "checkpoints" / "gpt-loss-loss"
    killed = {}

    def lose_the_worker_pod():  # the node under Worker 0 dies: every process of the pod, at once
        deadline = time.monotonic() + 300
        while not (ckpt / "iter_0000002").is_dir() and time.monotonic() < deadline:
            time.sleep(0.02)
        killed["pids"] = process_tree(launcher.processes["gpt-loss-loss-worker-0"].pid)
        launcher.kill_replica("gpt-loss-loss-worker-0")

    threading.Thread(target=lose_the_worker_pod, daemon=True).start()
    result = launcher.run(spec, run_id="loss", workdir=str(tmp_path), timeout_s=1500)
    text = "\n".join(lines)
    assert result.succeeded, result.describe(60) + text[-3000:]
    assert len(killed["pids"]) >= 2  # torchrun and its rank: the whole "pod"
    for pid in killed["pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The worker died by SIGKILL (137); its peer fails with it: two restarts counted against 3 x 2 nodes.
    assert "Restarting: gpt-loss-loss-worker-0 exited with code 137, its peers fail with it (restarts 2, " \
        "backoffLimit 6)" in text
    resumed = re.search(r"resumed from .*iter_(\d+) at iteration (\d+)", text)
    assert resumed, text[-3000:]
    assert int(resumed.group(2)) >= 2  # not from scratch
    assert re.search(r"iteration\s+8/8", text)
    assert (ckpt / "iter_0000008").is_dir()
    # The first start trained from iteration 1; after the restart nobody starts over.
    assert len(re.findall(r"iteration\s+1/8", text)) == 1
