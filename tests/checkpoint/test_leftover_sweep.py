"""Interrupted saves' temporaries are swept by the run that takes the save root, and only then: while another
live run holds ``DIR/.save.lock`` nothing is removed (``domino.checkpoint.leftovers``, ``save_root``). Real
processes holding real record locks, a real SIGKILL, real files.

The other run is a forked process that takes the root as a run's rank 0 does, writes its own
``.tmp-iter_*.<token>`` and stays alive until the test kills it.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from domino.checkpoint.save_root import HOLDER_FILE, LOCK_FILE, SaveRootBusy, SaveRootLock


def _other_run(root, writing=None) -> int:
    """Forks a process that takes ``root`` (creating ``writing`` under it afterwards, as a save in flight would),
    reports on a pipe, then sleeps until it is killed; returns its pid."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other run's rank 0
        try:
            os.close(read)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # not pytest's output: a runner waiting for it must not wait for this process
            os.dup2(devnull, 2)
            SaveRootLock(root, "other").acquire(timeout_s=0)
            if writing:
                (root / writing).mkdir()
                (root / writing / "part").write_bytes(b"in flight")
            os.write(write, b"1")
            while True:
                time.sleep(1)
        finally:
            os._exit(1)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    return pid


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _names(root):
    return sorted(p.name for p in root.iterdir())


def test_leftovers_go_only_when_no_other_live_run_holds_the_root(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="domino.checkpoint")
    root = tmp_path / "ckpt"
    root.mkdir()
    # sealed, killed mid-write (a token-less name of an older domino too), sealed but not renamed
    for name in ("iter_0000002", ".tmp-iter_0000003.dead1", ".tmp-iter_0000004", ".tmp-iter_0000004.dead2"):
        (root / name).mkdir()
    (root / "iter_0000002" / "manifest.json").write_text("{}")
    (root / ".tmp-iter_0000004.dead2" / "manifest.json").write_text("{}")  # killed between seal and rename
    (root / "latest").write_text("iter_0000002")

    other = _other_run(root, writing=".tmp-iter_0000009.other")  # the first to take the root: alone, it sweeps
    try:
        assert _names(root) == [LOCK_FILE, HOLDER_FILE, ".tmp-iter_0000009.other", "iter_0000002", "latest"]
        (root / ".tmp-iter_0000005.dead3").mkdir()  # what a third run, killed mid-save meanwhile, left
        ours = SaveRootLock(root, "ours")
        with pytest.raises(SaveRootBusy):
            ours.acquire(timeout_s=0)  # the other run lives: nothing goes, not even the dead one's leftover
        assert ".tmp-iter_0000009.other" in _names(root) and ".tmp-iter_0000005.dead3" in _names(root)
    finally:
        _kill(other)  # SIGKILL: the kernel drops its lock
    after = _other_run(root)  # the next run after it: alone, so it sweeps
    _kill(after)
    assert _names(root) == [LOCK_FILE, HOLDER_FILE, "iter_0000002", "latest"]
    assert (root / "iter_0000002" / "manifest.json").is_file()


def test_the_sweep_removes_every_leftover_and_the_trash_and_logs_them(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="domino.checkpoint")
    root = tmp_path / "ckpt"
    root.mkdir()
    for name in (".tmp-iter_0000003.a1", ".tmp-iter_0000237.b2", ".trash-iter_0000002", "iter_0000002"):
        (root / name).mkdir()
        (root / name / "model").mkdir()
    (root / ".tmp-iter_file").write_text("not a directory: not ours")
    lock = SaveRootLock(root, "ours")
    lock.acquire(timeout_s=0)
    lock.release()
    assert _names(root) == [LOCK_FILE, HOLDER_FILE, ".tmp-iter_file", "iter_0000002"]
    assert (f"removed 2 temporary directories of interrupted saves from {root}: .tmp-iter_0000003.a1, "
            ".tmp-iter_0000237.b2") in caplog.text
    assert f"removed .trash-iter_0000002 from {root}" in caplog.text
