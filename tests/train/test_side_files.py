"""Side files never end a run: a real ``domino pretrain`` whose ``--metrics-file`` and ``--tensorboard-dir`` lie on
a full disk (a 64 KiB tmpfs, filled, where the test can mount one as root; elsewhere a folder it may not write,
as permissions do not stop root) trains to the end, saves its checkpoint elsewhere, and says each failure in
exactly one warning."""

from __future__ import annotations

import errno
import os
import re
import subprocess

import pytest

from train_helpers import TINY, run_pretrain


@pytest.fixture
def unwritable(tmp_path):
    """A folder where writes fail: a full tmpfs, or (not root) a read-only folder."""
    folder = tmp_path / "full"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    assert mounted.returncode == 0, f"root could not mount a tmpfs: {mounted.stderr!r}"
    try:
        filler = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError) as full:
            for _ in range(1024):
                os.write(filler, b"\0" * 4096)
        os.close(filler)
        assert full.value.errno == errno.ENOSPC
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.timeout(300)
def test_a_full_disk_under_the_metrics_file_and_tensorboard_is_said_once_and_training_finishes(tmp_path, unwritable):
    metrics, board, save = unwritable / "metrics.jsonl", unwritable / "tb", tmp_path / "ckpt"
    proc = run_pretrain([*TINY, "--mock-data", "--train-iters", "3", "--eval-interval", "0", "--eval-iters", "0",
                         "--save", str(save), "--metrics-file", str(metrics), "--tensorboard-dir", str(board)],
                        timeout=300)
    assert (save / "iter_0000003").is_dir() and (save / "latest").is_file()  # the checkpoint is written
    assert re.search(r"iteration +3/3 \| ", proc.stdout + proc.stderr)  # the log lines go on to the end
    warnings = [line for line in proc.stderr.splitlines() if "write failed" in line]
    assert len(warnings) == 2, warnings
    assert [w for w in warnings if f"--metrics-file {metrics}: write failed (" in w]
    assert [w for w in warnings if f"--tensorboard-dir {board}" in w]
    assert "Traceback" not in proc.stderr
