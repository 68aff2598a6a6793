"""RNG tracker: TP regions draw per-rank numbers, the rest draws the same numbers; states round-trip."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from distributed_helpers import run_distributed
from domino.runtime import state
from domino.parallel.random import (
    get_rng_state,
    get_rng_tracker,
    model_parallel_seed,
    set_rng_state,
    tp_region_rng,
)


def test_fork_uses_its_own_stream_and_restores_the_default():
    model_parallel_seed(123)
    a = torch.rand(4)
    with get_rng_tracker().fork():
        inside_1 = torch.rand(4)
    b = torch.rand(4)
    model_parallel_seed(123)
    assert torch.equal(torch.rand(4), a)
    assert torch.equal(torch.rand(4), b)  # the fork did not consume the default stream
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(4), inside_1)
    assert not torch.equal(inside_1, a)


def test_unknown_state_and_duplicate_add_are_errors():
    tracker = get_rng_tracker()
    tracker.reset()
    with pytest.raises(KeyError, match="model_parallel_seed"):
        with tracker.fork():
            pass
    with tp_region_rng():  # a no-op without a tracker state (inference)
        torch.rand(1)
    tracker.add("x", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("x", 2)
    tracker.reset()


def test_get_and_set_rng_state_round_trip():
    model_parallel_seed(7)
    snap = get_rng_state()
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    with get_rng_tracker().fork():
        tp_drawn = torch.rand(3)
    set_rng_state(snap)
    assert random.random() == drawn[0] and np.random.rand() == drawn[1]
    assert torch.equal(torch.rand(3), drawn[2])
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(3), tp_drawn)


def _body(rank, world_size):
    mesh = state.initialize_model_parallel(2)
    model_parallel_seed(99, mesh.tp.rank)
    outside = torch.rand(8)
    with get_rng_tracker().fork():
        inside = torch.rand(8)
    return outside, inside


def test_tp_ranks_share_the_default_stream_but_not_the_tp_stream():
    (out0, in0), (out1, in1) = run_distributed(_body, 2)
    assert torch.equal(out0, out1)
    assert not torch.equal(in0, in1)


def test_context_parallel_ranks_get_their_own_tp_stream_and_share_the_default():
    """TP 2 x CP 2 played in one process: the four (tp, cp) places draw four TP streams, one default stream, and
    CP rank 0's TP stream is Megatron's ``seed + 2718 + tp_rank``."""
    draws = {}
    for cp_rank in (0, 1):
        for tp_rank in (0, 1):
            model_parallel_seed(5, tp_rank, cp_rank, tp_size=2)
            with tp_region_rng():
                draws[tp_rank, cp_rank] = torch.rand(6)
            draws["default", tp_rank, cp_rank] = torch.rand(6)
    tp_streams = [draws[t, c] for t in (0, 1) for c in (0, 1)]
    assert all(not torch.equal(a, b) for i, a in enumerate(tp_streams) for b in tp_streams[i + 1:])
    defaults = [draws["default", t, c] for t in (0, 1) for c in (0, 1)]
    assert all(torch.equal(defaults[0], d) for d in defaults[1:])
    assert torch.equal(draws[1, 0], torch.rand(6, generator=torch.Generator().manual_seed(5 + 2718 + 1)))
