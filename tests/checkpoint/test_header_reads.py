"""A resume reads the optimizer state a batch at a time (``domino.checkpoint.resume.READ_BATCH_BYTES``); every
file's safetensors header is parsed and checked once before the first batch, and each batch's read takes those
headers instead of parsing every file again. Two real gloo ranks (TP 2) save, then load with and without them."""

from __future__ import annotations

from pathlib import Path

from distributed_helpers import run_distributed

COLUMN = "exp_avg.layers.0.attention.dense.weight"  # split over TP along dim 1
ROW = "fp32.layers.0.attention.query_key_value.weight"  # split along dim 0
NORM = "fp32.layers.0.input_norm.weight"  # replicated


def _save_and_load(rank: int, world_size: int, base: str) -> dict:
    import torch

    from domino.checkpoint import distributed_io
    from domino.checkpoint.sharding import shard_state_dict
    from domino.runtime import state

    mesh = state.start(world_size, backend="gloo")
    generator = torch.Generator().manual_seed(0)
    whole = {COLUMN: torch.randn(4, 6, generator=generator), ROW: torch.randn(6, 4, generator=generator),
             NORM: torch.randn(4, generator=generator)}
    local = shard_state_dict(whole, rank, world_size)
    directory = Path(base) / "optimizer"
    distributed_io.save(directory, local, mesh)
    stored = distributed_io.stored_tensors(directory)

    parsed = []
    parse = distributed_io.stored_tensors
    distributed_io.stored_tensors = lambda d: parsed.append(d) or parse(d)
    try:
        given = {name: torch.zeros_like(t) for name, t in local.items()}
        distributed_io.load(directory, given, mesh, stored)  # the batches of a resume: no header parsed again
        parsed_with_headers = len(parsed)
        read = {name: torch.zeros_like(t) for name, t in local.items()}
        distributed_io.load(directory, read, mesh)  # alone, it reads them itself
    finally:
        distributed_io.stored_tensors = parse
    return {"parsed_with_headers": parsed_with_headers, "parsed_alone": len(parsed) - parsed_with_headers,
            "equal": all(torch.equal(given[n], local[n]) and torch.equal(read[n], local[n]) for n in local)}


def test_a_load_given_the_headers_parses_none_and_reads_the_same(tmp_path):
    for rank, result in enumerate(run_distributed(_save_and_load, 2, str(tmp_path))):
        assert result == {"parsed_with_headers": 0, "parsed_alone": 1, "equal": True}, (rank, result)
