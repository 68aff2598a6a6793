"""Everything a checkpoint or an export writes is as readable as its neighbours: under umask 022 every file is
0644 and every folder 0755 (safetensors' ``save_file`` alone would make the weights 0600), and a process of
another UID (nobody, 65534) reads every file, where the test runs as root. A real ``domino pretrain`` saves
the checkpoint; ``export-hf``, ``import-hf`` and both ``checkpoint convert`` forms then run on it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from train.train_helpers import run_pretrain

from domino.checkpoint.hf_interop import export_hf, import_hf
from domino.checkpoint.tools import convert_layout, convert_per_tensor

ARGS = ["--preset", "tiny", "--mock-data", "--log-interval", "1", "--num-workers", "0", "--seed", "7",
        "--train-iters", "1", "--eval-iters", "0", "--eval-interval", "0", "--zero-stage", "1"]
NOBODY = 65534


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path):
    """``{path relative to root: permission bits}`` of every file and folder below ``root``."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*") if not p.is_symlink()}


def _read_as_nobody(root: Path, names) -> int:
    """Reads every file in ``names`` (relative to ``root``) in a forked child that became UID/GID 65534 with no
    supplementary groups; returns the child's exit status (0: all read). ``root`` is opened before the switch,
    so only the permissions of ``root`` and below count (pytest's own base folder is 0700)."""
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for name in names:
                os.close(os.open(name, os.O_RDONLY, dir_fd=folder))
            status = 0
        finally:
            os._exit(status)
    os.close(folder)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.timeout(300)
def test_checkpoints_and_exports_follow_the_umask_and_another_uid_reads_them(tmp_path, umask_022):
    save = tmp_path / "ckpt"
    run_pretrain([*ARGS, "--save", str(save)], timeout=300, torchrun=True)  # its own process, under umask 022
    outputs = {"checkpoint": save, "export-hf": export_hf(save, tmp_path / "hf")}
    outputs["import-hf"] = import_hf(outputs["export-hf"], tmp_path / "imported").parent
    outputs["convert tp"] = convert_layout(save, tmp_path / "tp2", 2, progress=False)
    outputs["convert per-tensor"] = convert_per_tensor(save, tmp_path / "per-tensor", progress=False)

    for verb, root in outputs.items():
        modes = _modes(root)
        assert any(name.endswith(".safetensors") for name in modes), (verb, modes)
        wrong = {name: oct(mode) for name, mode in modes.items()
                 if mode != (0o755 if (root / name).is_dir() else 0o644)}
        assert not wrong, f"{verb}: {wrong}"
        files = sorted(name for name in modes if (root / name).is_file())
        if os.geteuid() == 0:  # becoming another UID needs root; elsewhere the modes above say the same
            assert _read_as_nobody(root, files) == 0, f"{verb}: UID {NOBODY} could not read {files}"
