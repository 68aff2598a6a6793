"""The dataset store shared by runs (domino/data/dataset_store.py), driven through the preprocess step by
real processes: readers during rebuilds, two runs of one key at once, killed and live writers.

Every process below is a separate Python interpreter running ``components.preprocess.step.run_group``
(what the pipeline's preprocess task runs) on the built-in ``shakespeare-small`` corpus.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from components.preprocess.step import plan_groups, run_group
from domino.data.dataset_store import DatasetStore
from domino.data.indexed_dataset import IndexedDataset
from domino.data.provenance import dataset_key, file_identity

ROOT = Path(__file__).resolve().parents[2]

# One preprocess task. argv: shared root, plan group (JSON), reuse (0/1), rounds, then optional
# marker files: "started" (touched when the writer opened its first output), "go" (waited for before
# the writer adds documents), "kill" (the task SIGKILLs itself after opening its output).
TASK = """
import json, os, signal, sys, time
from domino.data import indexed_dataset
from components.preprocess.step import run_group

shared, group, reuse, rounds, started, go, kill, log = sys.argv[1:9]
real_init = indexed_dataset.IndexedDatasetWriter.__init__
real_add = indexed_dataset.IndexedDatasetWriter.add_documents

def init(self, prefix, dtype):
    real_init(self, prefix, dtype)
    if log != "-":
        with open(log, "a") as handle:
            handle.write(os.path.abspath(prefix) + "\\n")

def add(self, *args, **kwargs):
    if started != "-":
        open(started, "w").close()
    if kill == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    while go != "-" and not os.path.exists(go):
        time.sleep(0.02)
    return real_add(self, *args, **kwargs)

indexed_dataset.IndexedDatasetWriter.__init__ = init
indexed_dataset.IndexedDatasetWriter.add_documents = add
for _ in range(int(rounds)):
    result = run_group(shared, json.loads(group), reuse=reuse == "1")
print(json.dumps(result))
"""

# A reader polling the published dataset: resolve the record, open every dataset it names, read it.
READER = """
import os, sys, time
from domino.data.dataset_store import DatasetStore
from domino.data.indexed_dataset import IndexedDataset

prefix, stop, out = sys.argv[1:4]
reads, failures = 0, []
while not os.path.exists(stop):
    record = DatasetStore.read_record(prefix)
    if record is None:
        failures.append("no complete dataset published")
        continue
    for path in record["prefixes"].values():
        try:
            dataset = IndexedDataset(path)
            sum(len(dataset[i]) for i in range(len(dataset)))
            reads += 1
        except Exception as error:
            failures.append(f"{type(error).__name__}: {error}")
with open(out, "w") as handle:
    handle.write("\\n".join([str(reads)] + failures[:5] + [f"failures={len(failures)}"]) + "\\n")
"""


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _task(shared, group, reuse=True, rounds=1, started="-", go="-", kill=False, log="-"):
    return subprocess.Popen([sys.executable, "-c", TASK, shared, json.dumps(group), "1" if reuse else "0", str(rounds),
                             str(started), str(go), "1" if kill else "0", str(log)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc=None, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"timed out waiting for {path}"
        time.sleep(0.02)


def _group(shared: str) -> dict:
    (group,) = plan_groups(shared, corpus="shakespeare-small")
    return group


def test_a_reader_never_misses_the_dataset_while_another_process_rebuilds_it(tmp_path):
    shared = str(tmp_path / "shared")
    group = _group(shared)
    run_group(shared, group)  # the first publication
    stop, out = tmp_path / "stop", tmp_path / "reader.txt"
    reader = subprocess.Popen([sys.executable, "-c", READER, group["output_prefix"], str(stop), str(out)], cwd=ROOT,
                              env=_env())
    try:
        writer = _task(shared, group, reuse=False, rounds=12)  # reuse_dataset=false, twelve times over
        _, errors = writer.communicate(timeout=600)
        assert writer.returncode == 0, errors
    finally:
        stop.touch()
        reader.wait(timeout=120)
    reads, *failures = out.read_text().splitlines()
    assert failures == ["failures=0"] and int(reads) > 0, failures
    folder = os.path.join(os.path.dirname(group["output_prefix"]), "builds")
    builds = sorted(os.listdir(folder))
    assert len(builds) == 13  # every build a reader may have opened is still there (superseded, not deleted)
    record = json.loads(Path(DatasetStore.record_path(group["output_prefix"])).read_text())
    made = sorted(builds, key=lambda name: os.stat(os.path.join(folder, name)).st_mtime_ns)
    assert builds == made  # names sort in the order the builds were made, also within one second
    assert record["build"] == builds[-1] and record["superseded"] == builds[:-1]


def test_two_runs_of_the_same_key_at_once_never_write_the_same_paths(tmp_path):
    shared = str(tmp_path / "shared")
    group = _group(shared)
    go = tmp_path / "go"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    started = [tmp_path / "a.started", tmp_path / "b.started"]
    tasks = [_task(shared, group, started=s, go=go, log=log) for s, log in zip(started, logs)]
    for marker, task in zip(started, tasks):
        _wait_for(marker, task)  # both are tokenising now: neither found the dataset done
    go.touch()
    results = []
    for task in tasks:
        out, errors = task.communicate(timeout=300)
        assert task.returncode == 0, errors
        results.append(json.loads(out))
    written = [set(log.read_text().split()) for log in logs]
    assert written[0] and written[1] and not written[0] & written[1]
    # The first publication won; the other run's build was discarded, and both name the published one.
    assert results[0]["prefixes"] == results[1]["prefixes"] == DatasetStore.read_record(group["output_prefix"])["prefixes"]
    builds = os.listdir(os.path.join(os.path.dirname(group["output_prefix"]), "builds"))
    assert len(builds) == 1 and IndexedDataset(results[0]["prefixes"]["text"]).num_documents == results[0]["documents"]


def test_a_killed_writers_build_is_swept_but_a_live_writers_is_not(tmp_path):
    shared = str(tmp_path / "shared")
    group = _group(shared)
    builds = Path(os.path.dirname(group["output_prefix"])) / "builds"
    killed = _task(shared, group, started=tmp_path / "k.started", kill=True)
    killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL
    (orphan,) = os.listdir(builds)
    assert any(name.startswith(".corpus_text_document.bin.tmp-") for name in os.listdir(builds / orphan))

    go = tmp_path / "go"
    live = _task(shared, group, started=tmp_path / "l.started", go=go)  # sweeps the orphan, then waits mid-build
    _wait_for(tmp_path / "l.started", live)
    (live_build,) = os.listdir(builds)
    assert live_build != orphan  # the dead writer's build is gone

    other = _task(shared, group, reuse=False)  # a third run starts, sweeps, tokenises and publishes meanwhile
    out, errors = other.communicate(timeout=300)
    assert other.returncode == 0, errors
    assert live_build in os.listdir(builds)  # the live writer's folder was left alone
    go.touch()
    out, errors = live.communicate(timeout=300)
    assert live.returncode == 0, errors
    assert json.loads(out)["prefixes"] == json.loads(
        Path(DatasetStore.record_path(group["output_prefix"])).read_text())["prefixes"]  # reuse: first one stands


def test_a_file_rewritten_with_the_same_size_and_mtime_gets_a_new_key(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "one two three"}\n')
    before = os.stat(path)
    key = dataset_key([file_identity(str(path))], "tok", ["text"])
    path.write_text('{"text": "one two THREE"}\n')  # same size, in place (same inode)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime restored
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_mtime_ns == before.st_mtime_ns
    assert dataset_key([file_identity(str(path))], "tok", ["text"]) != key
    replaced = tmp_path / "new.jsonl"
    replaced.write_text('{"text": "one two three"}\n')
    os.replace(replaced, path)  # replaced by a rename: a new inode
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert file_identity(str(path))["inode"] != before.st_ino


def test_what_a_killed_sweeper_left_aside_is_deleted_by_the_next_sweep(tmp_path):
    """A sweeper renames an orphan to ``.trash-<build>`` under the key's lock and deletes it after; killed in
    between, it leaves a hidden build-sized folder that no build or sweep would otherwise remove."""
    from domino.data.dataset_store import builds_folder, sweep_orphans

    prefix = DatasetStore(str(tmp_path)).dataset_prefix("k")
    trash = Path(builds_folder(prefix)) / ".trash-20260101T000000Z-host-7-0123abcd"
    trash.mkdir(parents=True)
    (trash / "corpus_text_document.bin").write_bytes(b"\0" * 64)
    assert sweep_orphans(prefix) == []  # no build of a writer was removed: this one was already aside
    assert not trash.exists()
