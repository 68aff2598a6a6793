"""The promotion lock is one that every NFS client sees: a record lock, tested with real processes.

Linux shares ``fcntl`` record locks between NFS clients (``nfs_lock`` sends them to the server), while
``flock`` on a directory stays in one client's kernel (``nfs_dir_operations`` has no ``.flock``, so
``fs/locks.c`` takes a local lock): see ``domino/file_lock.py``. There is no NFS server here, so the
tests check the two things that decide it on any file system: the lock a promote process holds is a
POSIX record lock on a regular file (``/proc/locks``), and another process's record lock on that file
is refused while it is held; and two processes promoting at once serialise.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.registry import lock_path, read_registry

ROOT = Path(__file__).resolve().parents[2]

# A promote process that pauses inside its read-check-write until told to go on.
PAUSED_PROMOTER = """
import sys, time, os
from components import registry

path, inside, go, run_id, ppl = sys.argv[1:6]
real_read = registry.read_registry

def read_and_wait(p):
    data = real_read(p)
    open(inside, "w").close()
    while not os.path.exists(go):
        time.sleep(0.02)
    return data

registry.read_registry = read_and_wait
entry = registry.PromotedModel(run_id=run_id, checkpoint_dir="/c/" + run_id, test_ppl=float(ppl), test_loss=1.0)
try:
    registry.promote(path, entry, gate_incumbent="")
    print("promoted")
except registry.RegistryError as error:
    print("refused:", error)
"""


def _start(tmp_path: Path, run_id: str, ppl: float, go: Path) -> tuple:
    inside = tmp_path / f"inside-{run_id}"
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_PROMOTER, str(tmp_path / "promoted.json"), str(inside),
                             str(go), run_id, str(ppl)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, inside


def _wait_for(predicate, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def _locks_of(pid: int) -> list:
    with open("/proc/locks", encoding="ascii") as handle:
        return [line.split() for line in handle if line.split()[4] == str(pid)]


def test_a_promote_process_holds_a_record_lock_that_another_process_cannot_take(tmp_path):
    go = tmp_path / "go"
    proc, inside = _start(tmp_path, "a", 20.0, go)
    try:
        _wait_for(inside.exists)
        held = _locks_of(proc.pid)
        assert held and all(fields[1] == "POSIX" for fields in held), held  # not FLOCK: that one is node-local
        lock_file = lock_path(str(tmp_path / "promoted.json"))
        inode = os.stat(lock_file).st_ino
        assert any(fields[5].endswith(f":{inode}") for fields in held)  # on the regular lock file
        descriptor = os.open(lock_file, os.O_RDWR)
        try:
            with pytest.raises(OSError):  # what a process on another NFS client asks for, refused while held
                fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(descriptor)
    finally:
        go.touch()
        out, _ = proc.communicate(timeout=60)
    assert out.strip() == "promoted"


def test_two_processes_promoting_at_once_serialise_and_the_better_model_wins(tmp_path):
    """Both gates saw no promoted model. Whoever locks first promotes; the second re-checks under the lock:
    the worse model is refused, the better one replaces the worse; the history never loses an entry."""
    go = tmp_path / "go"
    first, first_inside = _start(tmp_path, "worse", 25.0, go)
    second, second_inside = _start(tmp_path, "better", 20.0, go)
    try:
        _wait_for(lambda: first_inside.exists() or second_inside.exists())
        time.sleep(1.0)  # give the other process every chance to enter too: it must not
        assert first_inside.exists() != second_inside.exists()
    finally:
        go.touch()
        outputs = {"worse": first.communicate(timeout=60)[0].strip(), "better": second.communicate(timeout=60)[0].strip()}
    registry = read_registry(str(tmp_path / "promoted.json"))
    assert registry["current"].run_id == "better"
    history = [entry.run_id for entry in registry["history"]]
    assert history in (["better"], ["worse", "better"])
    if history == ["better"]:
        assert outputs["worse"].startswith("refused: ") and "was promoted after the gate" in outputs["worse"]
    assert json.loads((tmp_path / "promoted.json").read_text())["current"]["run_id"] == "better"
