"""The run's checkpoints as one value (``domino.checkpoint.manager``): a fresh start, a resume of the run's own
checkpoint, and a garbage ``--load`` refused in one line before anything is built. The loads themselves are the
pretraining resume tests' (test_checkpoint_commit, test_resume)."""

from __future__ import annotations

import pytest

from domino.checkpoint.manager import CheckpointManager
from domino.config import ConfigError, config_to_dict, parse_config
from domino.runtime.mesh import ParallelMesh


def _config(*flags):
    return parse_config(["--preset", "tiny", "--mock-data", *flags])


def test_an_empty_save_folder_is_a_fresh_start(tmp_path):
    checkpoints = CheckpointManager.open(_config("--save", str(tmp_path / "ckpt")), ParallelMesh.single())
    assert checkpoints.resume_from is None and not checkpoints.warm_start
    assert checkpoints.load(optimizer=None, padded_vocab_size=512) == (0, 0)  # nothing read or touched
    assert checkpoints.own_checkpoint(0) is None


def test_the_runs_own_checkpoint_is_resumed_and_named_as_its_own(tmp_path):
    from domino.checkpoint import on_disk

    ckpt = tmp_path / "ckpt" / on_disk.checkpoint_tag(3)
    ckpt.mkdir(parents=True)
    config = _config("--save", str(tmp_path / "ckpt"))
    meta = {"format_version": on_disk.FORMAT_VERSION, "iteration": 3, "consumed_samples": 24,
            "tensor_model_parallel_size": 1, "padded_vocab_size": 512, "tokenizer": None,
            "config": config_to_dict(config)}
    on_disk.write_checkpoint_meta(ckpt, meta)
    on_disk.write_latest(tmp_path / "ckpt", ckpt.name)
    checkpoints = CheckpointManager.open(config, ParallelMesh.single())
    assert checkpoints.resume_from is not None and checkpoints.resume_from.path == ckpt
    assert checkpoints.own_checkpoint(3) == str(ckpt)  # the loop does not write iteration 3 again
    assert checkpoints.own_checkpoint(4) is None


def test_a_load_that_is_not_a_checkpoint_is_refused_before_anything_is_built(tmp_path):
    other = tmp_path / "hf"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a domino checkpoint directory"):
        CheckpointManager.open(_config("--load", str(other)), ParallelMesh.single())
