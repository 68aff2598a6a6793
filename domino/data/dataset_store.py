"""Preprocessed datasets kept on a shared volume across runs, safe for many runs and nodes at once.

Layout under the shared root, for a dataset named by its key (:func:`domino.data.provenance.dataset_key`)::

    datasets/<key>/corpus.record.json                 the published record: which build is the dataset
    datasets/<key>/.corpus.lock                       the key's lock (a regular file, kept)
    datasets/<key>/builds/<build>/corpus_<json key>_document.{bin,idx,meta.json}
    datasets/parts/<group key>/...                    the same for one shard group (``part`` instead of ``corpus``)

The rules that make it safe to share:

* **A build is written in a folder of its own** (``<UTC time to the microsecond>-<host>-<pid>-<random>``), so two runs that
  compute the same key never write the same paths, and nothing a reader may have open is ever rewritten.
* **Publishing writes the record last**, atomically, under the key's lock (:func:`domino.file_lock.exclusive_lock`,
  an ``fcntl`` record lock that NFS clients share). A reader reads only the record and then the build it
  names: it sees the old dataset or the new one, whole, never a missing ``.idx``. With ``replace=False``
  (``reuse_dataset=true``) the first build published for a key wins and a later one is discarded; with
  ``replace=True`` (``reuse_dataset=false``) the new build becomes the dataset.
* **Published builds are never deleted by domino.** A build replaced by a later one stays where it is (the
  record lists it under ``superseded``), so a run still training on it is unaffected; delete superseded
  builds by hand once no run of that dataset is active. An NFS client may serve a cached record for up to
  its attribute-cache time (``acregmax``, 60 s by default, nfs(5)): it then names the previous build, which
  is still there.
* **Unpublished builds are deleted**: the loser of a race deletes its own at once; a build whose writer
  died (SIGKILL, lost node) still holds its ``.owner`` file, whose record lock no live process holds any
  more: the next build of the same key removes it (:func:`sweep_orphans`). A live writer keeps that lock
  for the whole build, so its folder is never touched.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set

from domino.atomic_files import atomic_write_text, fsync_directory, remove_orphan
from domino.file_lock import exclusive_lock, try_lock_descriptor

logger = logging.getLogger(__name__)

BUILDS = "builds"
OWNER = ".owner"
_TRASH = ".trash-"  # an orphan build renamed aside, being deleted
_LIVE_BUILDS: Set[str] = set()  # this process's unpublished builds: its own record locks would not stop a sweep


def record_path(prefix: str) -> str:
    """The record of the dataset published under the logical ``prefix``: ``{prefix}.record.json``."""
    return prefix + ".record.json"


def lock_path(prefix: str) -> str:
    """The lock file of the logical ``prefix``: ``.{name}.lock`` beside the record."""
    folder, name = os.path.split(os.path.abspath(prefix))
    return os.path.join(folder, f".{name}.lock")


def builds_folder(prefix: str) -> str:
    """Where the builds of the logical ``prefix`` live."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), BUILDS)


def read_record(prefix: str) -> Optional[Dict[str, Any]]:
    """The published record of the logical ``prefix`` if it and every dataset it names exist, else None."""
    from domino.data.indexed_dataset import data_file_path, index_file_path  # numpy only when a record is read

    record = _read_record_file(prefix)
    prefixes = record.get("prefixes") if record else None
    complete = prefixes and all(os.path.isfile(data_file_path(p)) and os.path.isfile(index_file_path(p))
                                for p in prefixes.values())
    return record if complete else None


def _build_name() -> str:
    # Microseconds so that the names of one host's builds sort in the order they were made (two builds of
    # one process within a second sorted by their random part before); the random part keeps names unique.
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"
    now = time.time_ns() // 1000
    stamp = time.strftime('%Y%m%dT%H%M%S', time.gmtime(now // 1_000_000)) + f".{now % 1_000_000:06d}Z"
    return f"{stamp}-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _kept_builds(record: Optional[Dict[str, Any]]) -> Set[str]:
    """Names of the builds a record publishes or lists as superseded (never swept)."""
    if not record:
        return set()
    return {str(record.get("build", ""))} | {str(name) for name in record.get("superseded", [])}


def sweep_orphans(prefix: str) -> List[str]:
    """Removes the unpublished builds of the logical ``prefix`` whose writer is gone; returns their paths.

    Under the key's lock (a publisher holds it while it writes the record and gives up its ``.owner``), a
    build is an orphan when its ``.owner`` file still exists, is the file we locked, no other process holds
    its record lock, and the record does not name the build. Orphans are renamed aside under the lock and
    deleted after it; so is what a sweeper killed while deleting left aside (``.trash-*``: two sweepers
    deleting the same one at once do no harm).
    """
    folder = builds_folder(prefix)
    if not os.path.isdir(folder):
        return []
    doomed = []
    with exclusive_lock(lock_path(prefix)):
        kept = _kept_builds(_read_record_file(prefix))
        for name in sorted(os.listdir(folder)):
            build = os.path.join(folder, name)
            if name.startswith(_TRASH):
                doomed.append((build, build))
                continue
            if name.startswith(".") or name in kept or build in _LIVE_BUILDS:
                continue
            trash = os.path.join(folder, f"{_TRASH}{name}")
            if remove_orphan(os.path.join(build, OWNER), functools.partial(os.rename, build, trash)):
                doomed.append((build, trash))
    for build, trash in doomed:
        shutil.rmtree(trash, ignore_errors=True)
        logger.warning("removed the unfinished dataset build %s (its writer is gone)", build)
    return [build for build, trash in doomed if build != trash]


def _read_record_file(prefix: str) -> Optional[Dict[str, Any]]:
    try:
        with open(record_path(prefix), encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class Build:
    """One run's unpublished dataset build: a unique folder, owned (record-locked) until published.

    Example::

        with Build(store.dataset_prefix(key)) as build:
            preprocess(inputs, build.prefix)
            record = build.publish({"prefixes": ..., ...}, replace=False)

    Leaving the block without publishing (an error, a lost race) deletes the folder.
    """

    def __init__(self, prefix: str) -> None:
        self.logical_prefix = os.path.abspath(prefix)
        sweep_orphans(self.logical_prefix)
        self.name = _build_name()
        self.folder = os.path.join(builds_folder(self.logical_prefix), self.name)
        os.makedirs(self.folder)
        self._owner = os.open(os.path.join(self.folder, OWNER), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        if not try_lock_descriptor(self._owner):  # a new file nobody else can know of yet
            raise RuntimeError(f"{self.folder}: cannot lock the new build's owner file")
        _LIVE_BUILDS.add(self.folder)
        self.prefix = os.path.join(self.folder, os.path.basename(self.logical_prefix))
        self.published = False

    def publish(self, record: Dict[str, Any], replace: bool) -> Dict[str, Any]:
        """Makes this build the dataset (record written last, under the key's lock) and returns the record.

        Args:
            record: What the record says about the dataset; ``prefixes`` must name this build's files.
            replace: Replace a dataset published meanwhile (True), or keep it and discard this build (False).

        Returns:
            The record now published: this build's, or (``replace=False``) the one that was there first.
        """
        with exclusive_lock(lock_path(self.logical_prefix)):
            current = read_record(self.logical_prefix)
            if current is not None and not replace:
                return current  # __exit__ deletes this build: nobody can have read it
            previous = _read_record_file(self.logical_prefix)
            superseded = sorted(_kept_builds(previous) - {""}) if previous else []
            record = {**record, "build": self.name, "superseded": superseded}
            atomic_write_text(record_path(self.logical_prefix), json.dumps(record, indent=2, sort_keys=True) + "\n")
            os.remove(os.path.join(self.folder, OWNER))  # before the lock goes: a sweeper then finds no owner
            fsync_directory(self.folder)
            self._release()
            self.published = True
        return record

    def _release(self) -> None:
        if self._owner >= 0:
            os.close(self._owner)
            self._owner = -1
        _LIVE_BUILDS.discard(self.folder)

    def discard(self) -> None:
        """Deletes the unpublished build."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self._release()

    def __enter__(self) -> "Build":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.published:
            self.discard()


@dataclass(frozen=True)
class DatasetStore:
    """The logical prefixes of the datasets under one shared root (see the module docstring).

    Attributes:
        root: The shared root.
    """

    root: str

    def dataset_prefix(self, key: str) -> str:
        """Logical prefix of the whole dataset ``key`` (its record is ``<prefix>.record.json``)."""
        return os.path.join(self.root, "datasets", key, "corpus")

    def part_prefix(self, group_key: str) -> str:
        """Logical prefix of one shard group's dataset."""
        return os.path.join(self.root, "datasets", "parts", group_key, "part")

    read_record = staticmethod(read_record)
    record_path = staticmethod(record_path)
