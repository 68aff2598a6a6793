"""One writer per save root: rank 0 of a training run holds ``DIR/.save.lock`` exclusively from start-up to exit.

Two runs writing one ``--save`` (a second command with the same flag, a replacement pod started while its
predecessor still finishes its SIGTERM save, a pod left running on a partitioned node) would race each other's
saves, ``latest`` and pruning. So before the run writes anything there, and before it decides what to resume (the
predecessor's last save must be committed first), rank 0 takes an exclusive record lock on ``DIR/.save.lock``
and keeps it until the process ends. A second run polls for it up to ``--save-lock-timeout-s``, then every rank
stops with one line naming the holder: host, pid and start time, from ``DIR/.save.lock.json``, which the holder
replaces atomically once it holds the lock (a file of its own, so a waiter never reads a half-written record and
the lock file stays one that only this module opens: closing any descriptor of it drops the process's lock,
fcntl(2)).

A holder that is gone needs no clean-up: record locks belong to a process and the kernel drops them when it
exits, SIGKILL included; on NFS the server does (a dead node's when its lease expires, 90 s by default on a Linux
server: within the default wait), :mod:`domino.file_lock`.
So "no lock held" is the only test of staleness: the record file of a dead holder stays, is never trusted, and
is overwritten by the next holder. Readers (``evaluate``, ``export-hf``, ``generate``, ``checkpoint inspect``)
take no lock: they only read committed checkpoints.

Holding the lock proves that no other live run writes into the root, so the holder removes the leftovers of
interrupted saves at once (:mod:`domino.checkpoint.leftovers`). Its temporary directories carry a token of its
own (``.tmp-iter_0000100.<token>``), so that even where the file system has no record locks (an NFS mount with
``nolock``) two writers never write into or delete each other's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Tuple

import torch.distributed as dist

from domino.atomic_files import atomic_write_text
from domino.checkpoint import leftovers
from domino.config import ConfigError, DominoConfig
from domino.file_lock import NO_LOCKS, try_lock_descriptor
from domino.runtime.agreement import agree

logger = logging.getLogger(__name__)

LOCK_FILE = ".save.lock"
HOLDER_FILE = ".save.lock.json"
#: How often a waiting run tries the lock: fcntl has no timed wait (F_SETLKW waits until a signal interrupts it,
#: fcntl(2)), and short tries let every rank follow the wait in agreed rounds.
POLL_S = 0.5


class SaveRootBusy(ConfigError):
    """Another live run holds the save root after ``--save-lock-timeout-s``."""


def _holder_text(root: Path) -> str:
    """The recorded holder in words, for the error (it is written just after the lock is taken)."""
    try:
        record = json.loads((root / HOLDER_FILE).read_text())
        return f"host {record['host']}, pid {record['pid']}, started {record['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"holder not recorded in {HOLDER_FILE}"


class SaveRootLock:
    """Rank 0's exclusive lock on a save root (see the module docstring), held until :meth:`release`.

    Args:
        root: the save root (``--save``).
        token: this run's writer token, recorded beside the host and pid (its temporary directories carry it).
        carried: ``token`` is a failed attempt's of this process (an in-process restart): the sweep spares its
            temporary directories, the save in flight then (:mod:`domino.checkpoint.inflight`).
    """

    def __init__(self, root: os.PathLike, token: str, carried: bool = False) -> None:
        self.root, self.token, self.carried = Path(root), token, carried
        self._descriptor: Optional[int] = None
        self._waiting = False

    def acquire(self, timeout_s: float) -> None:
        """Takes the lock, waiting up to ``timeout_s`` for a live holder (:meth:`try_acquire` until it holds).

        Raises:
            SaveRootBusy: still held by another process after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while not self.try_acquire(deadline, timeout_s):
            pass

    def try_acquire(self, deadline: float, timeout_s: float) -> bool:
        """One try: True once this run holds the root (recorded, leftovers swept; also where the file system has
        no record locks, said once); False after a pause of :data:`POLL_S` while another process holds it.

        Args:
            deadline: ``time.monotonic()`` after which a held lock is an error; ``timeout_s``: the setting, for it.

        Raises:
            SaveRootBusy: held by another process at ``deadline``.
        """
        if self._descriptor is None:
            self.root.mkdir(parents=True, exist_ok=True)
            # Read and write (lockf's exclusive lock needs write access); not inherited by programs started here.
            self._descriptor = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            held = try_lock_descriptor(self._descriptor)
        except OSError as error:
            self.release()
            if error.errno not in NO_LOCKS:
                raise
            logger.warning("%s: the file system has no record locks: a second run with this --save is not kept out "
                           "(its temporary directories are its own) and interrupted saves are not swept", self.root)
            return True
        if held:
            self._record_and_sweep()
            return True
        if time.monotonic() >= deadline:
            self.release()
            raise SaveRootBusy(f"--save {self.root} is held by another live run ({_holder_text(self.root)}) after "
                               f"waiting {timeout_s:g} s (--save-lock-timeout-s): stop it, wait for it, or give "
                               "this run another --save")
        if not self._waiting:
            self._waiting = True
            logger.warning("--save %s is held by another live run (%s): waiting up to %g s for it "
                           "(--save-lock-timeout-s)", self.root, _holder_text(self.root), timeout_s)
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        return False

    def _record_and_sweep(self) -> None:
        if self._waiting:
            logger.info("--save %s: the previous holder is gone; continuing", self.root)
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        atomic_write_text(str(self.root / HOLDER_FILE), json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "started": started, "token": self.token}) + "\n")
        # Alone: every temporary directory here is a dead run's, or a carried token's own save in flight.
        leftovers.sweep(self.root, self.token if self.carried else "")
        leftovers.sweep_trash(self.root)

    def release(self) -> None:
        """Drops the lock (closing the descriptor releases it); both files stay, as every lock file does."""
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None


def hold(config: DominoConfig, token: Optional[str] = None) -> Tuple[str, Optional[SaveRootLock]]:
    """Takes ``--save`` for this run (collective). Returns ``(token, lock)``: the writer token every rank names its
    temporary directories with, and rank 0's :class:`SaveRootLock` (None elsewhere, and without ``--save``).

    ``token`` (rank 0's counts): the writer token to carry on, an in-process restart's failed attempt's, whose
    save in flight is kept from the sweep (:mod:`domino.checkpoint.inflight`); default a new one.

    The wait is a series of short agreed rounds (rank 0 tries, every rank learns the outcome), so no rank waits in a
    collective for longer than a try, whatever ``--save-lock-timeout-s`` and ``--distributed-timeout-minutes`` are.

    Raises:
        AgreedFailure: on every rank, when another live run keeps the root past ``--save-lock-timeout-s``.
    """
    c = config.checkpoint
    if not c.save:
        return "", None
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    lock = SaveRootLock(c.save, token or uuid.uuid4().hex[:8], carried=bool(token)) if rank0 else None
    deadline = time.monotonic() + c.save_lock_timeout_s  # rank 0's clock decides
    shared = dist.is_initialized() and dist.get_world_size() > 1
    while True:
        held = [agree(f"taking --save {c.save}", lambda: lock.try_acquire(deadline, c.save_lock_timeout_s)
                      if lock is not None else None)]
        if shared:
            dist.broadcast_object_list(held, src=0)  # rank 0's outcome: go on, or try again
        if held[0]:
            break
    token = [lock.token if lock is not None else None]
    if shared:
        dist.broadcast_object_list(token, src=0)  # rank 0's token: every rank writes into the same directory
    return token[0], lock
