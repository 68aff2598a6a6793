"""Processes by parentage, from /proc: what a pod's processes are, to signal them as the kubelet or the signal relay
does (:mod:`domino.launch.local_backend`, :mod:`domino.launch.signal_relay`). Imports nothing heavy: the relay is a
pod's first process.
"""

from __future__ import annotations

import collections
import os
from typing import Dict, List


def children(pid: int) -> List[int]:
    """The processes whose parent is ``pid`` right now (none where there is no /proc)."""
    return _children_by_parent().get(pid, [])


def _children_by_parent() -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = collections.defaultdict(list)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    ppid = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out[ppid].append(int(entry))
    return out


def process_tree(pid: int) -> List[int]:
    """``pid`` and all its descendants (from /proc; just ``pid`` where there is no /proc).

    A replica is more than its process group: torchrun starts each rank in a session of its own
    (torch ``elastic/multiprocessing/subprocess_handler``: ``start_new_session``), so the ranks must be
    found by parentage, and before signalling (an orphan is re-parented to init).
    """
    if not os.path.isdir("/proc"):
        return [pid]
    by_parent = _children_by_parent()
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += by_parent.get(current, [])
    return tree


def signal_tree(pids: List[int], sig: int) -> None:
    """Sends ``sig`` to every process of ``pids`` (gone ones are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def alive(pids: List[int]) -> List[int]:
    """The processes of ``pids`` that still run (not gone, not a zombie waiting to be reaped); where there is no
    /proc, every process that still exists."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                    out.append(pid)
        except (OSError, IndexError):
            if not os.path.isdir("/proc"):
                try:
                    os.kill(pid, 0)
                    out.append(pid)
                except OSError:
                    pass
    return out


def container_exit_code(returncode: int) -> int:
    """A process's exit code as a container reports it: killed by signal N (``returncode`` -N) -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode
