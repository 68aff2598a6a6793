"""Reading a save root while its run prunes it (issue 56, item 8; ``domino/checkpoint/live_reads.py``).

Before the fix ``export-hf --load ROOT`` of a live run with ``--keep-last 1`` failed with "iter_0000012 ... lacks
.../tp_rank_00.safetensors" (pruned, not damaged) and ``checkpoint inspect`` called such a checkpoint DAMAGED.
Here a real ``domino pretrain`` with ``--keep-last 1`` runs exactly while the reader is between opening the
checkpoint and reading its files (the reader's own step is wrapped to start the run there and wait for it): the
reader of a save root reads the new latest, the reader of an ``iter_*`` directory says in one line that it was
removed and which checkpoint is the latest now.
"""

from __future__ import annotations

import argparse
import json
import logging

import pytest
from train.train_helpers import run_pretrain

from domino.checkpoint import hf_interop, live_reads, tools
from domino.cli import checkpoint as checkpoint_cli, hf as hf_cli

BASE = ["--preset", "tiny", "--mock-data", "--num-layers", "1", "--log-interval", "1",
        "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "0", "--save-interval", "1"]


def _train(save, iterations: int) -> None:
    """The live run: continues ``save`` to ``iterations`` with --keep-last 1 (its schedule grows on purpose)."""
    run_pretrain([*BASE, "--save", str(save), "--train-iters", str(iterations), "--keep-last", "1",
                  "--override-opt_param-scheduler"])


def _prune_first(monkeypatch, owner, name: str, save, iterations: int) -> None:
    """Makes the reader's step ``owner.name`` run the live run once, just before it reads the checkpoint's files."""
    real = getattr(owner, name)
    pending = [iterations]

    def step(*args, **kwargs):
        if pending:
            _train(save, pending.pop())
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, step)


@pytest.fixture()
def save(tmp_path):
    root = tmp_path / "ckpt"
    run_pretrain([*BASE, "--save", str(root), "--train-iters", "1"])
    return root


def test_export_of_a_root_pruned_under_it_exports_the_new_latest(save, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="domino.checkpoint.live_reads")
    _prune_first(monkeypatch, hf_interop.model_shards, "load_full_state_dict", save, 2)
    out = tmp_path / "hf"
    assert hf_cli.run_export(argparse.Namespace(load=str(save), output=str(out), tokenizer=None,
                                                overwrite=False)) == 0
    assert not (save / "iter_0000001").exists()  # the live run did prune it under the reader
    assert json.loads((out / "config.json").read_text())["domino"]["iteration"] == 2
    assert (f"{save / 'iter_0000001'} was removed while it was read (pruned or replaced by the run writing {save}): "
            "reading iter_0000002, the latest now") in caplog.text


def test_a_named_checkpoint_pruned_under_its_reader_is_said_in_one_line(save, tmp_path, monkeypatch):
    _prune_first(monkeypatch, hf_interop.model_shards, "load_full_state_dict", save, 2)
    with pytest.raises(live_reads.CheckpointRemoved) as caught:
        hf_cli.run_export(argparse.Namespace(load=str(save / "iter_0000001"), output=str(tmp_path / "hf"),
                                             tokenizer=None, overwrite=False))
    assert str(caught.value) == (f"{save / 'iter_0000001'} was removed while it was read (pruned or replaced by the "
                                 f"run writing {save}); {save}'s latest checkpoint is now iter_0000002: read that")
    assert not (tmp_path / "hf").exists()


def test_inspect_never_calls_a_pruned_checkpoint_damaged(save, monkeypatch, capsys):
    _prune_first(monkeypatch, tools, "_verify_all", save, 2)
    code = checkpoint_cli._inspect(argparse.Namespace(load=str(save), no_verify=False, no_progress=True, json=True))
    found = json.loads(capsys.readouterr().out)
    assert code == 0 and found["iteration"] == 2 and found["integrity"].startswith("intact"), found["integrity"]
