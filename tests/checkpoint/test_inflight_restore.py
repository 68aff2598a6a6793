"""The save in flight at an in-process restart's failure (``domino.checkpoint.inflight``): the restarted attempt
commits and resumes it only when every rank kept its part complete, agreed over the (new) process groups on two
real gloo ranks; a rank without it makes every rank resume the newest durable checkpoint, and its temporary
directory goes. The whole restart, with real torchrun, is tests/train/test_inprocess_restart.py's."""

from __future__ import annotations

from pathlib import Path

from distributed_helpers import run_distributed
from domino.checkpoint import inflight, leftovers
from domino.checkpoint.inflight import Parked

TOKEN = "feedc0de"  # the failed attempt's writer token


def _config(root: Path):
    from domino.config import parse_config

    return parse_config(["--preset", "tiny", "--mock-data", "--save", str(root), "--inprocess-restart",
                         "--async-save"])


def _checkpoint(directory: Path, config, iteration: int) -> None:
    """A checkpoint's ``checkpoint.json`` (what choosing and checking it read) in ``directory``."""
    from domino.checkpoint import on_disk
    from domino.config import config_to_dict

    directory.mkdir(parents=True)
    on_disk.write_checkpoint_meta(directory, {
        "format_version": on_disk.FORMAT_VERSION, "iteration": iteration, "consumed_samples": 8 * iteration,
        "tensor_model_parallel_size": 1, "padded_vocab_size": 512, "tokenizer": None,
        "config": config_to_dict(config)})


def _restart(rank: int, world_size: int, base: str, kept: dict) -> dict:
    """For each case: iter_0000002 committed, iter_0000004 written into the failed attempt's temporary directory,
    this rank's record as ``kept[case][rank]`` says; then the restarted attempt's CheckpointManager.open."""
    import torch.distributed as dist

    from domino.checkpoint import on_disk
    from domino.checkpoint.manager import CheckpointManager
    from domino.runtime.mesh import ParallelMesh

    outcome = {}
    for case, records in sorted(kept.items()):
        root = Path(base) / case
        config = _config(root)
        tmp = root / f".tmp-{on_disk.checkpoint_tag(4)}.{TOKEN}"
        if rank == 0:
            _checkpoint(root / on_disk.checkpoint_tag(2), config, 2)
            on_disk.write_latest(root, on_disk.checkpoint_tag(2))
            _checkpoint(tmp, config, 4)
        dist.barrier()
        if records[rank] is not None:
            inflight.park(Parked(str(root), 4, TOKEN, written=records[rank]))
        checkpoints = CheckpointManager.open(config, ParallelMesh.single())
        checkpoints.close()
        outcome[case] = {"inflight": checkpoints.inflight, "resumed": checkpoints.resume_from.path.name,
                         "latest": (root / "latest").read_text().strip(), "tmp_left": tmp.exists()}
        dist.barrier()
    return outcome


def test_the_save_in_flight_is_resumed_only_when_every_rank_kept_it_complete(tmp_path):
    kept = {"both": [True, True], "rank1-lacks-it": [True, None], "rank1-write-failed": [True, False],
            "rank0-lacks-it": [None, True]}
    results = run_distributed(_restart, 2, str(tmp_path), kept)
    for rank, outcome in enumerate(results):
        # Every rank kept iteration 4 complete: committed through the ordinary commit, and the one resumed.
        assert outcome["both"] == {"inflight": 4, "resumed": "iter_0000004", "latest": "iter_0000004",
                                   "tmp_left": False}, rank
        # One rank without it (or with a failed write): every rank resumes iteration 2, and nothing of 4 is left.
        for case in ("rank1-lacks-it", "rank1-write-failed", "rank0-lacks-it"):
            assert outcome[case] == {"inflight": None, "resumed": "iter_0000002", "latest": "iter_0000002",
                                     "tmp_left": False}, (rank, case)


def test_the_choice_needs_every_rank_on_the_same_checkpoint():
    a = Parked("/s", 4, "t", True)
    assert inflight.choose([a, a]) == a
    assert inflight.choose([a]) == a
    assert inflight.choose([a, None]) is None and inflight.choose([None, a]) is None
    assert inflight.choose([a, Parked("/s", 4, "t", False)]) is None
    assert inflight.choose([a, Parked("/s", 6, "t", True)]) is None  # parts of two saves
    assert inflight.choose([a, Parked("/s", 4, "u", True)]) is None


def test_the_holders_sweep_spares_its_own_temporary_directories(tmp_path):
    (tmp_path / f".tmp-iter_0000004.{TOKEN}").mkdir()
    (tmp_path / ".tmp-iter_0000004.deadbeef").mkdir()
    assert leftovers.sweep(tmp_path, TOKEN) == [".tmp-iter_0000004.deadbeef"]
    assert leftovers.sweep(tmp_path) == [f".tmp-iter_0000004.{TOKEN}"]  # a fresh holder's: every one goes


def test_a_lost_peer_report_says_an_in_process_restart_may_resume_the_save_in_flight(tmp_path):
    from domino.checkpoint import checkpointing, on_disk
    from domino.config import parse_config

    config = _config(tmp_path)
    _checkpoint(tmp_path / on_disk.checkpoint_tag(2), config, 2)
    on_disk.write_latest(tmp_path, on_disk.checkpoint_tag(2))
    assert checkpointing.resume_hint(config) == (
        f"`latest` in {tmp_path} names iter_0000002: a restart resumes from it (an in-process restart: from the "
        "save in flight, if every rank wrote its part)")
    plain = parse_config(["--preset", "tiny", "--mock-data", "--save", str(tmp_path), "--async-save"])
    assert checkpointing.resume_hint(plain) == f"`latest` in {tmp_path} names iter_0000002: a restart resumes from it"
