"""The signal relay (the training container's first process) gives torchrun's ranks the whole grace period.

Real torchrun (torch 2.13) with ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1`` stands in for a torchrun that SIGKILLs its
ranks 30 s after a SIGTERM it receives whatever the grace period (a torch without pytorch/pytorch#172596, as
the default CUDA base ships): a rank that needs 3 s after SIGTERM is killed when torchrun gets the signal, and
finishes when the relay gets it instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from domino.launch.processes import process_tree, signal_tree
from domino.launch.signal_relay import GRACE_PERIOD_ENV, Relay, is_torchrun

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    rank = os.environ["RANK"]
    def finish(signum, frame):
        with open(os.path.join(out, "signalled-" + rank), "w") as f:
            f.write(os.environ.get("{grace}", "-"))
        time.sleep(3)  # a save that outlasts torchrun's 1 s
        open(os.path.join(out, "saved-" + rank), "w").close()
        sys.exit(143)
    signal.signal(signal.SIGTERM, finish)
    open(os.path.join(out, "ready-" + rank), "w").close()
    while True:
        time.sleep(0.05)
""").format(grace=GRACE_PERIOD_ENV)


@pytest.fixture
def started():
    """The process trees the test starts, killed whole at its end (a failing test leaves none running)."""
    procs = []
    yield procs
    for proc in procs:
        signal_tree(process_tree(proc.pid), signal.SIGKILL)
        proc.wait()


def _start(tmp_path, relayed: bool, max_restarts: int = 0) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.1",
                "--max-restarts", str(max_restarts), str(script), str(tmp_path)]
    relay = [sys.executable, "-m", "domino.launch.signal_relay", "--grace-period-s", "60"]
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"}
    proc = subprocess.Popen([*relay, *torchrun] if relayed else torchrun, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("max_restarts", [0, 3])
def test_a_sigterm_to_the_relay_reaches_the_ranks_and_they_finish_past_torchruns_timeout(tmp_path, max_restarts,
                                                                                          started):
    """Like the kubelet stopping the container: SIGTERM to its first process only. The ranks get it, finish their
    3 s, read the grace period the relay exported, and the container exits 143 (retryable under ExitCode). With
    ``--max-restarts`` torchrun would start the ranks again; the relay signals torchrun once they are gone."""
    proc = _start(tmp_path, relayed=True, max_restarts=max_restarts)
    started.append(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    for rank in (0, 1):
        assert (tmp_path / f"saved-{rank}").exists()
        assert (tmp_path / f"signalled-{rank}").read_text() == "60"


def test_without_the_relay_torchrun_kills_the_ranks_at_its_timeout(tmp_path, started):
    """The control: the same SIGTERM to torchrun itself, which forwards it and SIGKILLs 1 s later."""
    proc = _start(tmp_path, relayed=False)
    started.append(proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert (tmp_path / "signalled-0").exists() and (tmp_path / "signalled-1").exists()
    assert not (tmp_path / "saved-0").exists() and not (tmp_path / "saved-1").exists()


def test_a_command_that_is_not_torchrun_gets_the_signal_itself_and_its_code_passes_through(tmp_path):
    assert is_torchrun(["torchrun", "-m", "x"]) and is_torchrun([sys.executable, "-m", "torch.distributed.run"])
    assert not is_torchrun(["python", "-m", "domino", "pretrain"])
    ok = Relay([sys.executable, "-c", "pass"])
    while (status := ok.poll()) is None:
        time.sleep(0.01)
    assert ok.exit_code(status) == 0
    marker, ready = tmp_path / "got", tmp_path / "up"
    trapped = Relay([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: ("
                     f"open({str(marker)!r}, 'w').close(), sys.exit(3))); open({str(ready)!r}, 'w').close(); "
                     "time.sleep(60)"])
    while not ready.exists():  # the child has installed its handler
        time.sleep(0.01)
    trapped.on_signal(signal.SIGTERM, None)
    while (status := trapped.poll()) is None:
        time.sleep(0.01)
    assert marker.exists() and status == 3 and trapped.exit_code(status) == 143


def test_the_relay_imports_only_the_standard_library_and_processes():
    """The relay starts every restart, before torchrun: the package's public names (both backends, the job
    renderers, domino.config) load only when read, so importing the relay takes none of them; and they still
    load on first use."""
    code = ("import sys; import domino.launch.signal_relay; "
            "ours = sorted(m for m in sys.modules if m.startswith('domino')); "
            "assert ours == ['domino', 'domino.launch', 'domino.launch.processes', 'domino.launch.signal_relay'], ours; "
            "from domino.launch import JobSpec, JobResult, LaunchSpecError, Toleration, run_job, naming; "
            "import domino.launch as launch; assert launch.run_job is run_job and 'domino.launch.api' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
