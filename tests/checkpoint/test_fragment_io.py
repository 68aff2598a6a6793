"""The optimizer state stored as ZeRO fragments (``fragment_io``): each rank's ranges of its flattened TP slice
placed as boxes of a ``[TP rows, slice elements]`` matrix, read back whole on any TP size.

Four writers (TP 2 x DP 2) are played by one process, each saving its fragments alone (DCP without a process
group), their files then put in one directory under the names DCP gives four ranks' files: what a real save
leaves. The fragments cut the flattened slices at arbitrary places (mid-row, as ZeRO's flat partition does).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from domino.checkpoint import fragment_io
from domino.checkpoint.on_disk import CheckpointError
from domino.optim.state import Fragment
from domino.checkpoint.sharding import shard_state_dict
from domino.runtime.mesh import MeshGroup, ParallelMesh

COLUMN = "exp_avg.layers.0.attention.dense.weight"  # split over TP along dim 1
ROW = "fp32.layers.0.attention.query_key_value.weight"  # split along dim 0
NORM = "fp32.layers.0.input_norm.weight"  # replicated


def _whole():
    generator = torch.Generator().manual_seed(0)
    return {COLUMN: torch.randn(4, 6, generator=generator), ROW: torch.randn(6, 4, generator=generator),
            NORM: torch.randn(4, generator=generator)}


def _write(tmp_path, whole, cut):
    """Saves TP 2 x DP 2 writers' fragments (DP rank d holds elements [0, cut) or [cut, n) of each slice, cut
    mid-row) into one directory; returns it."""
    target = tmp_path / "optimizer"
    target.mkdir()
    for tp_rank in range(2):
        slices = shard_state_dict(whole, tp_rank, 2)
        for dp_rank in range(2):
            fragments = {}
            for name, local in slices.items():
                if name == NORM and tp_rank:
                    continue  # replicated: the same boxes as TP rank 0's, which a real save's DCP plan keeps once
                flat = local.reshape(-1)
                start, end = (0, cut[name]) if dp_rank == 0 else (cut[name], flat.numel())
                fragments[name] = Fragment(flat[start:end].clone(), start, tuple(local.shape))
            mesh = dataclasses.replace(ParallelMesh.single(), tp=MeshGroup.shapes_only(2, tp_rank))
            alone = tmp_path / f"writer-{tp_rank}-{dp_rank}"
            with warnings.catch_warnings():  # DCP warns that it saves without a process group
                warnings.simplefilter("ignore", UserWarning)
                fragment_io.save(alone, fragments, mesh)
            (written,) = [p for p in alone.iterdir() if p.suffix == ".safetensors"]
            writer = tp_rank * 2 + dp_rank
            written.rename(target / f"shard-{writer + 1:05d}-model-00001-of-00001.safetensors")
    return target


@pytest.mark.parametrize("cut", [{COLUMN: 5, ROW: 7, NORM: 1}, {COLUMN: 1, ROW: 11, NORM: 3}])
def test_fragments_cut_mid_row_read_back_whole(tmp_path, cut):
    whole = _whole()
    directory = _write(tmp_path, whole, cut)
    shapes = {name: tuple(t.shape) for name, t in whole.items()}
    read = fragment_io.read_whole(directory, None, 2, shapes)
    assert sorted(read) == sorted(whole)
    for name, tensor in whole.items():
        assert torch.equal(read[name], tensor), name
    # The stored form: one row per TP rank for split tensors, one row for the replicated norm.
    from domino.checkpoint.distributed_io import stored_tensors

    stored = stored_tensors(directory)
    assert stored[COLUMN].shape == (2, 12) and stored[ROW].shape == (2, 12) and stored[NORM].shape == (1, 4)


def test_read_whole_given_the_headers_parses_none(tmp_path, monkeypatch):
    """A resume on another TP size reads a batch at a time: each takes the headers parsed before the first."""
    from domino.checkpoint import distributed_io

    whole = _whole()
    directory = _write(tmp_path, whole, {COLUMN: 5, ROW: 7, NORM: 1})
    stored = distributed_io.stored_tensors(directory)
    monkeypatch.setattr(distributed_io, "stored_tensors", lambda d: pytest.fail(f"{d}'s headers parsed again"))
    read = fragment_io.read_whole(directory, [ROW, NORM], 2, {n: tuple(whole[n].shape) for n in whole}, stored)
    assert sorted(read) == sorted([ROW, NORM]) and all(torch.equal(read[n], whole[n]) for n in read)


def test_a_stored_matrix_that_does_not_fit_its_tensor_is_refused(tmp_path):
    whole = _whole()
    directory = _write(tmp_path, whole, {COLUMN: 5, ROW: 7, NORM: 1})
    with pytest.raises(CheckpointError, match=r"exp_avg.layers.0.attention.dense.weight is stored as \[2, 12\], "
                                              r"which is not a tensor of shape \(4, 8\)"):
        fragment_io.read_whole(directory, [COLUMN], 2, {COLUMN: (4, 8)})
    with pytest.raises(CheckpointError, match="not a tensor of shape .* cut over 3 TP ranks"):
        fragment_io.read_whole(directory, [ROW], 3, {ROW: (6, 4)})


@pytest.mark.parametrize("recorded, expected", [
    ({"format": "by-name", "step": 3}, None),
    ({"format": "by-name", "storage": "slices"}, None),
    ({"format": "by-name", "storage": "fragments", "tensor_model_parallel_size": 4}, 4),
])
def test_the_recorded_form(recorded, expected):
    assert fragment_io.fragments_tp({"optimizer": recorded}, "ckpt/checkpoint.json") == expected


@pytest.mark.parametrize("recorded", [
    {"storage": "fragments"}, {"storage": "fragments", "tensor_model_parallel_size": 0},
    {"storage": "fragments", "tensor_model_parallel_size": True}, {"storage": "zipped"},
])
def test_a_malformed_form_is_one_line(recorded):
    with pytest.raises(CheckpointError, match="ckpt/checkpoint.json: field optimizer must say storage"):
        fragment_io.fragments_tp({"optimizer": recorded}, "ckpt/checkpoint.json")
