"""The multi-process harness itself: real gloo ranks, results by rank, failures surfaced."""

import pytest
import torch
import torch.distributed as dist

from distributed_helpers import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


def test_all_reduce_across_two_ranks():
    assert run_distributed(_sum_ranks, 2) == [3.0, 3.0]


def test_failure_is_reported_with_traceback():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail_on_rank_one, 2)
