"""``--async-save`` with real processes, real SIGKILLs and real files (the scenario: ``async_save_scenario.py``).

One launch (a :mod:`forked_ranks` zygote) runs a 2-rank DP=2 ZeRO-1 job saving synchronously at every
iteration, then a chain of asynchronous runs of the same job that are SIGKILLed at random moments (seeds
below) while saves are in flight, each resumed by the next. The tests read what it recorded:

* asynchronous checkpoints equal the synchronous ones, file by file;
* after every kill, ``latest`` names an intact checkpoint, no checkpoint under its final name is torn, and
  the next run resumes from the checkpoint ``latest`` names, the newest complete one, repeating the
  reference's losses bit for bit;
* training went on while a checkpoint was written (a commit is logged after a later iteration);
* a background write failing on one rank (a full disk) stops every rank with the same one-line error.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.async_save_scenario import TRAIN_ITERS as ITERS

SEEDS = "11,12,13"


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    out = tmp_path_factory.mktemp("async-save")
    helper = Path(__file__).with_name("forked_ranks.py")
    proc = subprocess.run([sys.executable, str(helper), "async_save_scenario:run", str(out), SEEDS],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    result["out"] = out
    return result


def _safetensors(path: Path):
    """A safetensors file as (header, data): the header parsed, since safetensors writes its ``__metadata__``
    from a Rust HashMap (``safetensors/src/tensor.rs``: ``Metadata``), whose key order changes from run to
    run, so two writes of the same tensors differ in their header bytes."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _comparable(ckpt: Path, name: str):
    path = ckpt / name
    if name == "checkpoint.json":  # the runs differ in where they save and log, and in --async-save
        meta = json.loads(path.read_text())
        for key in ("save", "load", "async_save"):
            meta["config"]["checkpoint"].pop(key)
        meta["config"]["logging"].pop("metrics_file")
        return meta
    if name.endswith(".safetensors"):
        return _safetensors(path)
    if name == "manifest.json":  # the digests of the files above differ with them; the others must match
        files = json.loads(path.read_text())["files"]
        return {k: v for k, v in files.items() if k != "checkpoint.json" and not k.endswith(".safetensors")}
    return path.read_bytes()


def test_async_checkpoints_equal_the_synchronous_ones(scenario):
    sync, asynchronous = scenario["out"] / "sync", scenario["out"] / "async"
    assert scenario["reference"]["status"] == [0, 0]
    assert scenario["runs"][-1]["status"] == [0, 0], scenario["runs"][-1]["log_tail"]
    tags = sorted(p.name for p in asynchronous.glob("iter_*"))
    assert tags == sorted(p.name for p in sync.glob("iter_*")) == [f"iter_{i:07d}" for i in range(1, ITERS + 1)]
    for tag in tags:
        names = sorted(str(p.relative_to(sync / tag)) for p in (sync / tag).rglob("*") if p.is_file())
        assert names == sorted(str(p.relative_to(asynchronous / tag)) for p in (asynchronous / tag).rglob("*")
                               if p.is_file())
        assert any(n.startswith("optimizer/") for n in names) and any(n.startswith("model/") for n in names)
        for name in names:
            assert _comparable(sync / tag, name) == _comparable(asynchronous / tag, name), f"{tag}/{name}"


def test_sigkill_during_async_saves_resumes_the_newest_complete_checkpoint(scenario):
    reference = scenario["reference"]["losses"]
    runs = scenario["runs"]
    assert [r["seed"] for r in runs] == [int(s) for s in SEEDS.split(",")] + [None]
    previous = None
    for killed, resumed in zip(runs, runs[1:]):
        seed, after = killed["seed"], killed["after"]
        # Each killed run committed a checkpoint of its own first (the kill waits for one): every restart
        # resumes from an asynchronous checkpoint, and the kills land in later saves.
        assert after["latest"] is not None and (previous is None or after["latest"] > previous), (seed, after)
        previous = after["latest"]
        # Both ranks killed, or the second one gone first with domino's lost-peer report (exit status 128).
        first, second = killed["status"][killed["killed_first"]], killed["status"][1 - killed["killed_first"]]
        assert killed["reached"] and first == -9 and second in (-9, 128), (seed, killed["status"])
        # Nothing under a final name is torn: every iter_ directory is sealed and passes its CRC-32 check.
        assert all(after["intact"].values()), (seed, after)
        assert after["latest"] in after["intact"], (seed, after)
        newer = [t for t in after["intact"] if t > after["latest"]]
        # At most the checkpoint whose commit the kill cut short between its rename and `latest`.
        assert len(newer) <= 1, (seed, after)
        assert resumed["resumed_from"] == after["latest"], (seed, after, resumed["log_tail"])
        assert not resumed["damaged"], resumed["log_tail"]
        start = int(after["latest"][5:])
        assert sorted(int(i) for i in resumed["losses"])[0] == start + 1
        assert resumed["losses"] == {i: reference[i] for i in resumed["losses"]}, seed  # bit for bit
    assert runs[-1]["after"]["latest"] == f"iter_{ITERS:07d}"


def test_training_goes_on_while_a_checkpoint_is_written(scenario):
    """Some commit is logged after a later iteration than the one it saved: the step did not wait for it."""
    later = []
    for run in scenario["runs"]:
        stepped = 0
        for kind, number in run["events"]:
            if kind == "step":
                stepped = number
            elif stepped > number:
                later.append((number, stepped))
    assert later, [r["events"] for r in scenario["runs"]]


def test_a_background_write_failing_on_one_rank_stops_every_rank_with_one_line(scenario):
    """A full disk on rank 1 while the iteration after the last is written in the background: at a later step
    every rank exits with the same agreed line naming rank 1, and the previous checkpoint and ``latest`` stay."""
    full, save = scenario["disk_full"], scenario["out"] / "async"
    assert full["status"] == [2, 2], full
    (line,), (other,) = full["errors"]
    assert line == other
    assert "rank 1 (node " in line and "rank 0 (node " not in line
    assert f"failed while saving checkpoint iter_{ITERS + 1:07d} (optimizer state)" in line
    assert "File too large" in line
    assert f"`latest` in {save} names iter_{ITERS:07d}: a restart resumes from it" in line
    assert full["tracebacks"] == [False, False]
    assert full["after"]["latest"] == f"iter_{ITERS:07d}" and full["unchanged"]
    assert not [n for n in full["after"]["names"] if n.startswith(".tmp-")]  # the temporary directory was removed
