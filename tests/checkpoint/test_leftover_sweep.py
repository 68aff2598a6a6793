"""Interrupted saves' temporaries are swept at a run's first save only when no other live run writes into the save
root (``domino.checkpoint.leftovers``): real processes holding real record locks, a real SIGKILL, real files.

The other runs are forked processes that claim the root as a run's rank 0 does and then stay alive (one of them
writing its own ``.tmp-iter_*``) until the test kills them.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from domino.checkpoint.leftovers import LOCK_FILE, SaveRootClaim


def _other_run(root, writing=None) -> int:
    """Forks a process that claims ``root`` (creating ``writing`` under it afterwards, as a save in flight would),
    reports on a pipe, then sleeps until it is killed; returns its pid."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other run's rank 0
        try:
            os.close(read)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # not pytest's output: a runner waiting for it must not wait for this process
            os.dup2(devnull, 2)
            SaveRootClaim(root).claim()
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
    caplog.set_level(logging.INFO, logger="domino.checkpoint.leftovers")
    root = tmp_path / "ckpt"
    root.mkdir()
    for name in ("iter_0000002", ".tmp-iter_0000003", ".tmp-iter_0000004"):  # sealed, killed mid-write, sealed
        (root / name).mkdir()
    (root / "iter_0000002" / "manifest.json").write_text("{}")
    (root / ".tmp-iter_0000004" / "manifest.json").write_text("{}")  # killed between seal and rename
    (root / "latest").write_text("iter_0000002")

    other = _other_run(root, writing=".tmp-iter_0000009")  # a run that claims first: alone, it sweeps
    try:
        assert _names(root) == [LOCK_FILE, ".tmp-iter_0000009", "iter_0000002", "latest"]
        (root / ".tmp-iter_0000005").mkdir()  # what a third run, killed mid-save meanwhile, left
        ours = SaveRootClaim(root)
        assert ours.claim() == []  # the other run lives: nothing goes, not even the dead one's leftover
        assert ".tmp-iter_0000009" in _names(root) and ".tmp-iter_0000005" in _names(root)
        assert "another live run holds .save.lock" in caplog.text
        assert ours.claim() == []  # once per run
        ours.release()
    finally:
        _kill(other)  # SIGKILL: the kernel drops its lock
    after = _other_run(root)  # the next run after it: alone, so it sweeps
    _kill(after)
    assert _names(root) == [LOCK_FILE, "iter_0000002", "latest"]
    assert (root / "iter_0000002" / "manifest.json").is_file()


def test_the_sweep_removes_every_leftover_and_logs_them(tmp_path, caplog):
    root = tmp_path / "ckpt"
    root.mkdir()
    for name in (".tmp-iter_0000003", ".tmp-iter_0000237", "iter_0000002"):
        (root / name).mkdir()
        (root / name / "model").mkdir()
    (root / ".tmp-iter_file").write_text("not a directory: not ours")
    claim = SaveRootClaim(root)
    assert claim.claim() == [".tmp-iter_0000003", ".tmp-iter_0000237"]
    claim.release()
    assert _names(root) == [LOCK_FILE, ".tmp-iter_file", "iter_0000002"]
    assert f"removed 2 temporary directories of interrupted saves from {root}" in caplog.text
