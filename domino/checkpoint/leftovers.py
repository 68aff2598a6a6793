"""The temporary directories of interrupted saves: swept at a run's first save, unless another live run writes there.

A save fills ``DIR/.tmp-iter_NNNNNNN`` and renames it into place once every rank's part is durable
(:mod:`domino.checkpoint.checkpointing`). A process killed before that rename (SIGKILL, the OOM killer, a lost
node, a SIGTERM whose grace period ran out during the save) or a run that fails while its asynchronous save is in
flight leaves the directory behind, as large as a checkpoint. The next save of the same iteration replaces it, but
one whose iteration is never saved again (the SIGTERM save of iteration 237 with ``--save-interval 100``, a
changed interval) would stay forever.

Deleting one is safe only when no live process writes into it: two runs can share a save root (a pod still
running on a partitioned node while its replacement starts; a second command with the same ``--save``), and an
asynchronous save's directory is being written while its run trains on. So rank 0 of every run that saves holds
a *shared* record lock on ``DIR/.save.lock`` from its first save until it ends, and at that first save, before
taking it, tries the *exclusive* lock without waiting. Getting it proves that no other live run holds the file,
so every ``.tmp-iter_*`` in the root is a leftover of a dead one (this run has written none yet): they are
removed, with a log line. Held elsewhere, nothing is removed (logged too). Record locks are the kind every NFS
client shares through the server and the kernel drops when its process dies, SIGKILL included; they are not
inherited by forked children such as data-loader workers (fcntl(2); :mod:`domino.file_lock`). A file system
without record locks is never swept.

Only ``.tmp-iter_*`` directories are removed: never a checkpoint under its final name, sealed or not, nor
``latest``, nor anything else in the root. A ``.tmp-iter_*`` that was sealed but not renamed (a kill between the
two) was never committed: ``latest`` names an older checkpoint, so resume never takes it either.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import List, Optional

from domino.file_lock import try_lock_descriptor

logger = logging.getLogger(__name__)

LOCK_FILE = ".save.lock"
LEFTOVER_GLOB = ".tmp-iter_*"
TRASH_GLOB = ".trash-iter_*"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
#: What an NFS client returns where its server refuses to convert a held lock. NFSv4 servers without atomic
#: downgrade answer LOCK with NFS4ERR_LOCK_NOTSUPP (RFC 7530, 16.10.5), which Linux's client maps to EIO (it has
#: no case for it in ``nfs4_map_errors``, ``fs/nfs/nfs4proc.c``: every unmapped NFSv4 error becomes ``-EIO``);
#: NLM (NFSv3) refusals come back as ENOLCK.
_CONVERSION_REFUSED = (errno.EIO, *_NO_LOCKS)


class SaveRootClaim:
    """This run's shared lock on a save root (rank 0's), taken at its first save and held until :meth:`release`.

    Args:
        root: the save root (``--save``).
    """

    def __init__(self, root: os.PathLike) -> None:
        self.root = Path(root)
        self._descriptor: Optional[int] = None
        self._claimed = False

    def claim(self) -> List[str]:
        """Claims the root (once; later calls do nothing) and first removes the leftovers of interrupted saves
        when no other live run holds it. Returns the names removed."""
        if self._claimed:
            return []
        self._claimed = True
        # Read and write: lockf's exclusive lock needs write access, its shared one read access.
        descriptor = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            alone = try_lock_descriptor(descriptor)
        except OSError as error:
            os.close(descriptor)
            if error.errno not in _NO_LOCKS:
                raise
            logger.info("%s: the file system has no record locks: leftovers of interrupted saves are not swept",
                        self.root)
            return []
        self._descriptor = descriptor
        removed = self._sweep() if alone else []
        if not alone:
            leftovers = sorted(p.name for p in self.root.glob(LEFTOVER_GLOB))
            if leftovers:
                logger.info("%s: another live run holds %s: its temporary directories (%s) are left alone",
                            self.root, LOCK_FILE, ", ".join(leftovers))
        # Shared from now on: other runs may claim the root too, but none can sweep it while this one lives.
        # Waits only while another run holds the exclusive lock for its own sweep.
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_SH)
        except OSError as error:
            if not (alone and error.errno in _CONVERSION_REFUSED):
                raise
            # Still exclusive: nothing can sweep while this run lives, as intended; a second run claiming the root
            # waits at its first save until this one ends, instead of this one failing.
            logger.warning("%s: the file system refused to turn the exclusive lock on %s into a shared one (%s): "
                           "keeping it exclusive", self.root, LOCK_FILE, os.strerror(error.errno))
        return removed

    def _sweep(self) -> List[str]:
        removed = []
        for leftover in sorted(self.root.glob(LEFTOVER_GLOB)):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
                removed.append(leftover.name)
        if removed:
            logger.warning("removed %d temporary director%s of interrupted saves from %s: %s", len(removed),
                           "y" if len(removed) == 1 else "ies", self.root, ", ".join(removed))
        return removed

    def sweep_trash(self) -> List[str]:
        """Removes the checkpoints renamed aside (``.trash-iter_*``) that a save killed while deleting them left.

        Each is a replaced or pruned checkpoint that resume never reads (:mod:`domino.checkpoint.discovery` looks
        at ``latest`` and ``iter_*`` only) and every save deletes anyway, so no lock is needed; a run that saves
        nothing (restarted after its last iteration) calls this at its start, as its saves would have.
        """
        removed = []
        for trash in sorted(self.root.glob(TRASH_GLOB)) if self.root.is_dir() else ():
            if trash.is_dir() and not trash.is_symlink():
                shutil.rmtree(trash, ignore_errors=True)  # another run deleting it too: either finishes it
                removed.append(trash.name)
        if removed:
            logger.info("removed %s from %s (checkpoints replaced or pruned, left by a save killed while deleting "
                        "them)", ", ".join(removed), self.root)
        return removed

    def release(self) -> None:
        """Drops the lock (closing the descriptor releases it); the lock file stays, as every lock file does."""
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None
