"""A killed ``export-hf`` or ``import-hf`` leaves its staging folder (``.OUT.XXXXXXXX/``, partly written) beside
the output; the next run of the verb for that output removes it, and only it: a live writer's staging folder and
a folder of the user's with a similar name stay. The leftovers are made by real processes, one SIGKILLed and
one alive, each holding its staging folder as an export does (``domino.atomic_files.StagingDirectory``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from domino.checkpoint.hf_interop import export_hf, import_hf
from eval_checkpoints import save_checkpoint, tiny_config, tiny_model, tiny_tokenizer

#: A writer that opens a staging folder for argv[1], writes part of a file into it, says where, and waits.
WRITER = ("import sys, time; from domino.atomic_files import StagingDirectory; "
          "s = StagingDirectory(sys.argv[1]); open(s.path + '/model.safetensors', 'wb').write(b'x' * 4096); "
          "print(s.path, flush=True); time.sleep(600)")


@pytest.fixture
def writers():
    """Starts writers (``start(output)`` -> (process, its staging folder)); kills what is left at the end."""
    started = []

    def start(output: Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(output)], stdout=subprocess.PIPE, text=True,
                                env=env)
        started.append(proc)
        return proc, Path(proc.stdout.readline().strip())

    yield start
    for proc in started:
        proc.kill()
        proc.wait(30)


def _killed(start, output: Path) -> Path:
    proc, staging = start(output)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    return staging


def test_the_next_export_and_import_sweep_the_staging_folders_of_killed_ones_only(tmp_path, writers):
    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    config = tiny_config(str(tmp_path / "tok"))
    save_checkpoint(tmp_path / "ckpt", tiny_model(config, tokenizer.vocab_size, seed=4), config, tokenizer=tokenizer)
    hf, imported = tmp_path / "hf", tmp_path / "imported"
    live_proc, live = writers(hf)  # first: each new staging folder sweeps the dead ones of its output
    dead = [_killed(writers, hf), _killed(writers, imported)]
    users = tmp_path / ".hf.mine"  # the user's, named like a staging folder but never one
    users.mkdir()
    assert all(folder.is_dir() for folder in (*dead, live))

    export_hf(tmp_path / "ckpt", hf)
    assert not dead[0].exists() and live.is_dir() and users.is_dir()
    assert (hf / "model.safetensors").is_file() and not (hf / ".staging-owner").exists()
    import_hf(hf, imported)
    assert not dead[1].exists() and (imported / "latest").is_file()
    assert not [p for p in imported.rglob(".staging-owner")]

    live_proc.kill()  # once its writer is gone, the next export takes it too
    live_proc.wait(30)
    export_hf(tmp_path / "ckpt", hf, overwrite=True)
    assert not live.exists() and users.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".hf.mine"]
