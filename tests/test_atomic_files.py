"""domino/atomic_files.py: a failure at any step of a write leaves the old file whole under the final name.

Faults are injected into each step in turn (the caller's write, flush/fsync, the rename, the directory
fsync) and, with a real SIGKILL, into a separate process halfway through its write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from domino import atomic_files
from domino.atomic_files import atomic_write, atomic_write_text, commit, temporary_name

OLD = b"old content, complete\n" * 100
NEW = b"new content, complete\n" * 200


class Fault(Exception):
    """The injected failure."""


@pytest.fixture
def target(tmp_path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(OLD)
    return path


def _siblings(path: Path) -> list:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def _write_in_halves(path: Path, check_between=None) -> None:
    with atomic_write(str(path)) as handle:
        handle.write(NEW[: len(NEW) // 2])
        handle.flush()
        if check_between:
            check_between()
        handle.write(NEW[len(NEW) // 2:])


def test_success_replaces_the_file_and_leaves_no_temporary(target):
    _write_in_halves(target)
    assert target.read_bytes() == NEW
    assert _siblings(target) == []


def test_a_half_written_file_is_never_visible_under_the_final_name(target):
    seen = []
    _write_in_halves(target, check_between=lambda: seen.append(target.read_bytes()))
    assert seen == [OLD]  # mid-write, a reader of the final name sees the old file, whole


def test_an_error_in_the_callers_write_keeps_the_old_file(target):
    with pytest.raises(Fault):
        with atomic_write(str(target)) as handle:
            handle.write(NEW[:100])
            raise Fault
    assert target.read_bytes() == OLD
    assert _siblings(target) == []  # the temporary was removed


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_failing_fsync_or_rename_keeps_the_old_file(target, monkeypatch, step):
    calls = []

    def failing(*args):
        calls.append(args)
        raise OSError(5, f"injected {step} failure")

    monkeypatch.setattr(atomic_files.os, step, failing)
    with pytest.raises(OSError, match=f"injected {step} failure"):
        _write_in_halves(target)
    monkeypatch.undo()
    assert calls, f"os.{step} was never called"
    assert target.read_bytes() == OLD
    assert _siblings(target) == []


def test_the_rename_happens_after_the_data_is_synced(target, monkeypatch):
    """fsync of the temporary's data comes before the rename that publishes it (else a power cut after the
    rename can leave an empty file under the final name)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(atomic_files.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(atomic_files.os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    _write_in_halves(target)
    assert events.index("fsync") < events.index("replace")
    assert target.read_bytes() == NEW


def test_a_failing_directory_fsync_after_the_rename_leaves_the_complete_new_file(target, monkeypatch):
    def failing(directory):
        raise Fault("directory fsync")

    monkeypatch.setattr(atomic_files, "fsync_directory", failing)
    with pytest.raises(Fault):
        _write_in_halves(target)
    assert target.read_bytes() == NEW  # already renamed: the final name holds the whole new file
    assert _siblings(target) == []


def test_atomic_write_text_and_commit_keep_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "a.txt"
    atomic_write_text(str(path), "one")
    monkeypatch.setattr(atomic_files.os, "replace", lambda a, b: (_ for _ in ()).throw(Fault("replace")))
    with pytest.raises(Fault):
        atomic_write_text(str(path), "two")
    temporary = temporary_name(str(path))
    Path(temporary).write_text("three")
    with pytest.raises(Fault):
        commit(temporary, str(path))
    monkeypatch.undo()
    assert path.read_text() == "one"
    commit(temporary, str(path))
    assert path.read_text() == "three" and _siblings(path) == []


KILLED_WRITER = """
import os, signal, sys
from domino.atomic_files import atomic_write
with atomic_write(sys.argv[1]) as handle:
    handle.write(b"partial new content" * 1000)
    handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_writer_killed_mid_write_leaves_the_old_file(target):
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(target)], capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(atomic_files.__file__).parents[1])})
    assert proc.returncode == -signal.SIGKILL
    assert target.read_bytes() == OLD
    leftovers = _siblings(target)  # a kill cannot clean up: the partial file stays under a hidden temporary name
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{target.name}.tmp-")
