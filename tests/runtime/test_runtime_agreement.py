"""Agreed steps on real gloo ranks: a failure on one rank stops every rank with the same one-line error.

Each rank returns the error text it would print instead of raising, so the test can compare the ranks.
"""

from __future__ import annotations

import socket

import numpy as np

from distributed_helpers import run_distributed


def _outcome(fn):
    from domino.runtime.agreement import AgreedFailure

    try:
        return {"result": fn()}
    except AgreedFailure as failure:
        return {"error": str(failure)}


def _one_rank_fails(rank, world_size):
    from domino.config import ConfigError
    from domino.runtime.agreement import agree

    def step():
        if rank == 1:
            raise ConfigError("/data/x.idx: truncated\n(second line)")
        return rank

    first = _outcome(lambda: agree("checking the data", step))
    second = _outcome(lambda: agree("a later step", lambda: rank * 10))  # the ranks are still in step
    return first, second


def test_a_failure_on_one_rank_is_raised_on_every_rank():
    results = run_distributed(_one_rank_fails, 2)
    (first0, second0), (first1, second1) = results
    expected = f"rank 1 (node {socket.gethostname()}) failed while checking the data: /data/x.idx: truncated " \
               "(second line)"
    assert first0 == first1 == {"error": expected}
    assert second0 == {"result": 0} and second1 == {"result": 10}


def _nested(rank, world_size):
    from domino.config import ConfigError
    from domino.runtime.agreement import agree

    def outer():
        if rank == 0:
            raise ConfigError("rank 0 fails before the inner agreement")
        return agree("the inner step", lambda: "inner done")

    return _outcome(lambda: agree("the outer step", outer))


def test_a_rank_failing_before_an_inner_agreement_meets_its_peers_there():
    results = run_distributed(_nested, 2)
    assert results[0] == results[1]
    assert results[0]["error"].startswith("rank 0 (node ") and "while the outer step" in results[0]["error"]


def _datasets(rank, world_size, prefixes, cache_dir):
    from domino.data.dataset_builder import build_train_valid_test_datasets
    from domino.runtime.agreement import agree

    return _outcome(lambda: agree("building the datasets", lambda: len(build_train_valid_test_datasets(
        [prefixes[rank]], "1", [16, 0, 0], 8, 5, True, data_cache_path=cache_dir)[0])))


def test_a_dataset_damaged_on_one_rank_stops_both_while_rank_0_builds_the_index_cache(tmp_path):
    """Rank 1 sees a truncated .idx; rank 0 is inside the index cache's agreement, and both stop."""
    from domino.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    for prefix in (good, bad):
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            for n in rng.integers(2, 12, size=20):
                writer.add_document(rng.integers(1, 99, size=int(n)))
    with open(bad + ".idx", "r+b") as handle:
        handle.truncate(30)
    results = run_distributed(_datasets, 2, [good, bad], str(tmp_path / "cache"))
    assert results[0] == results[1]
    assert results[0]["error"].startswith("rank 1 (node ") and "bad.idx" in results[0]["error"]


def _group_timeouts(rank, world_size):
    import torch

    from domino.runtime import state

    state.initialize_model_parallel(1, timeout_minutes=3)
    # The gloo backend's options hold the group's timeout (no public getter in torch 2.13).
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for g in (state.get_tensor_model_parallel_group(), state.get_data_parallel_group())]


def test_distributed_timeout_minutes_bounds_the_tp_and_dp_groups_too():
    """Without an explicit timeout, dist.new_group gives gloo groups 30 minutes whatever the world's is."""
    assert run_distributed(_group_timeouts, 2) == [[180.0, 180.0], [180.0, 180.0]]


def test_nccl_async_error_handling_is_switched_on_unless_the_user_chose(caplog):
    from domino.runtime.state import _check_nccl_error_handling

    environ = {}
    _check_nccl_error_handling(environ)
    assert environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    legacy = {"NCCL_ASYNC_ERROR_HANDLING": "0"}
    _check_nccl_error_handling(legacy)
    assert legacy["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and "will not end the process" in caplog.text
    chosen = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    _check_nccl_error_handling(chosen)
    assert chosen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # the user's choice is kept
