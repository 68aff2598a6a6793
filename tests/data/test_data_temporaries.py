"""Temporaries of killed writers are swept at the next start; a live writer's are never touched.

Real processes and signals: one ``domino preprocess`` is SIGKILLed mid-write (its ``.bin`` temporary
stays), a second is paused mid-write on the same output, a third runs to the end meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from domino.data.indexed_dataset import IndexedDataset

ROOT = Path(__file__).resolve().parents[2]

# argv: input, output prefix, mode (kill | pause | run), marker "started", marker "go".
WRITER = """
import os, signal, sys, time
from domino.data import indexed_dataset
from domino.data.preprocess import preprocess

source, prefix, mode, started, go = sys.argv[1:6]
real_add = indexed_dataset.IndexedDatasetWriter.add_documents

def add(self, *args, **kwargs):
    real_add(self, *args, **kwargs)
    self._bin.flush()
    open(started, "w").close()
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while mode == "pause" and not os.path.exists(go):
        time.sleep(0.02)

indexed_dataset.IndexedDatasetWriter.add_documents = add
print(preprocess([source], prefix).documents)
"""


def _start(tmp_path, prefix, mode, name):
    started = tmp_path / f"{name}.started"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "corpus.jsonl"), prefix, mode, str(started),
                             str(tmp_path / "go")], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 120
    while not started.exists():
        assert proc.poll() is None or mode == "kill", proc.communicate()
        assert time.monotonic() < end
        time.sleep(0.02)
    return proc


def _temporaries(folder: Path) -> set:
    return {p.name for p in folder.iterdir() if ".tmp-" in p.name}


def test_a_killed_writers_temporaries_are_swept_and_a_live_writers_are_kept(tmp_path):
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                                                   for i in range(300)))
    out = tmp_path / "out"
    out.mkdir()
    prefix = str(out / "web")
    killed = _start(tmp_path, prefix, "kill", "killed")
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    orphans = _temporaries(out)
    assert len(orphans) == 1 and next(iter(orphans)).startswith(".web_text_document.bin.tmp-")
    assert (out / next(iter(orphans))).stat().st_size > 0  # a partial corpus

    paused = _start(tmp_path, prefix, "pause", "paused")
    live = _temporaries(out) - orphans
    assert len(live) == 1
    finished = subprocess.run([sys.executable, "-m", "domino", "preprocess", "--input", str(tmp_path / "corpus.jsonl"),
                               "--output-prefix", prefix], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert _temporaries(out) == live  # the dead writer's partial file is gone, the live writer's is kept
    (tmp_path / "go").touch()
    stdout, stderr = paused.communicate(timeout=120)
    assert paused.returncode == 0 and stdout.strip() == "300", stderr
    assert _temporaries(out) == set()
    assert IndexedDataset(prefix + "_text_document").num_documents == 300


def test_a_temporary_with_this_processes_pid_is_swept_unless_this_process_has_it_open(tmp_path):
    """Pods have pid namespaces of their own: a retried step's process often has the pid of the killed one
    whose temporaries it finds. What tells ours apart is that we have them open (and locked)."""
    from domino.atomic_files import open_owned_temporary, sweep_temporaries

    final = tmp_path / "web_text_document.bin"
    left = tmp_path / f".{final.name}.tmp-{os.getpid()}-0123abcd"  # a killed writer's, same pid as ours
    left.write_bytes(b"partial corpus")
    live_path, live = open_owned_temporary(str(final))  # a live writer in this process
    with live:
        assert sweep_temporaries([str(final)]) == [str(left)]
        assert os.path.exists(live_path)
    os.remove(live_path)
