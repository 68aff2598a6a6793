"""What the training container's main process, torchrun (torch 2.13), exits with: what the operator's
``ExitCode`` restart policy decides on (training-operator v1.9.0 ``pkg/controller.v1/common/pod.go``: a Failed
pod is recreated when its ``pytorch`` container exited with ``>= 128``, ``pkg/util/train/train_util.go``
``IsRetryableExitCode``; any other code fails the job).

torchrun exits 1 when a worker fails, whatever the worker's code (``ChildFailedError``), and 1 on SIGTERM
once its workers run (``elastic/multiprocessing/api.py`` ``_terminate_process_handler`` raises
``SignalException``, which nothing catches: ``launcher/api.py`` ``launch_agent`` re-raises it). So under
``ExitCode`` a lost peer, or a SIGTERM that torchrun receives (the worker's own 143 is not passed on), is a
permanent failure; ``OnFailure`` restarts both. docs/cluster.md "Restarts" relies on these codes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from domino.launch.local_backend import retryable

WORKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # what --exit-signal-handler's run ends with
open(sys.argv[1], "w").write(str(os.getpid()))
if len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
time.sleep(120)
"""


def _torchrun(tmp_path, *args: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                             "--monitor-interval", "0.1", str(script), str(tmp_path / "started"), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_a_failed_worker_makes_torchrun_exit_1_whatever_its_own_code(tmp_path):
    proc = _torchrun(tmp_path, "137")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "ChildFailedError" in err
    assert not retryable("ExitCode", proc.returncode) and retryable("OnFailure", proc.returncode)


def test_sigterm_to_torchrun_ends_it_with_1_not_143(tmp_path):
    proc = _torchrun(tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # the worker runs: torchrun's own SIGTERM handler is installed (PContext.start)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "SignalException" in err, err[-2000:]
    assert not retryable("ExitCode", proc.returncode)
