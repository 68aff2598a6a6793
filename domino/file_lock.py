"""Locks that every node of a cluster sees: POSIX record locks (``fcntl``) on regular files.

The shared volume of a pipeline is usually NFS, and only one kind of lock is shared between NFS clients
in every configuration we can rely on (Linux, torvalds/linux):

* ``fcntl``/``lockf`` record locks go to the server: ``nfs_lock`` (``fs/nfs/file.c``) hands them to
  ``NFS_PROTO(inode)->lock`` (NLM for NFSv3, the LOCK operation for NFSv4). They stay local to one
  client only on a mount with ``nolock`` or ``local_lock=posix|all`` (``NFS_MOUNT_LOCAL_FCNTL``; nfs(5)),
  where no file lock of any kind is shared.
* ``flock`` on an NFS *regular file* has been emulated with a whole-file record lock on the server since
  Linux 2.6.12 (``nfs_flock``: "We're simulating flock() locks using posix locks on the server"; flock(2)),
  local with ``local_lock=flock|all`` (``NFS_MOUNT_LOCAL_FLOCK``). On an NFS *directory* it is always
  local: ``nfs_dir_operations`` (``fs/nfs/dir.c``) has no ``.flock``, so the system call falls back to
  ``locks_lock_file_wait`` (``fs/locks.c``), a lock only that client's kernel knows. Two pods on two
  nodes could both hold it.

Record locks belong to a process (fcntl(2)): the kernel releases them when the process exits, also on
SIGKILL (on NFSv4 a dead *node*'s locks go when its lease expires: 90 s by default on a Linux server,
``nfsd4_init_leases_net`` in ``fs/nfsd/nfs4state.c``);
closing *any* descriptor of the file releases them too, and the threads of one process never exclude
each other. So a lock file here is opened by this module only, one descriptor per holder, and an
in-process lock per path keeps threads apart as well.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from typing import Dict, Iterator

#: What a file system without record locks answers (an NFS mount with ``nolock`` gives ENOLCK, others EOPNOTSUPP or
#: ENOSYS; fcntl(2)): callers that can do without a lock carry on unlocked, and say so.
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_THREAD_LOCKS: Dict[str, threading.Lock] = {}  # one per lock file: record locks do not exclude threads
_THREAD_LOCKS_GUARD = threading.Lock()


class LockBusy(Exception):
    """A non-blocking attempt found the lock held by another process."""


def _thread_lock(path: str) -> threading.Lock:
    with _THREAD_LOCKS_GUARD:
        return _THREAD_LOCKS.setdefault(path, threading.Lock())


def try_lock_descriptor(descriptor: int) -> bool:
    """Takes an exclusive record lock on an open (writable) file without waiting; False when held elsewhere."""
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):  # fcntl(2): either may mean "held by another process"
            return False
        raise
    return True


@contextlib.contextmanager
def exclusive_lock(path: str, blocking: bool = True) -> Iterator[None]:
    """Holds an exclusive record lock on the regular file ``path`` (created if missing, never deleted).

    A lock file stays in place: deleting it would let a waiter lock the old inode while a newcomer locks
    a new file of the same name.

    Args:
        path: The lock file.
        blocking: Wait for the lock (default); with False raise :class:`LockBusy` at once when it is held.

    Raises:
        LockBusy: ``blocking`` is False and another process or thread holds the lock.
        OSError: the file system has no record locks (ENOLCK), with what to do about it.
    """
    path = os.path.abspath(path)
    guard = _thread_lock(path)
    if not guard.acquire(blocking):
        raise LockBusy(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # lockf's exclusive lock needs write access
        try:
            try:
                if blocking:
                    fcntl.lockf(descriptor, fcntl.LOCK_EX)
                elif not try_lock_descriptor(descriptor):
                    raise LockBusy(path)
            except OSError as error:
                if error.errno != errno.ENOLCK:
                    raise
                # NFSv3 locks go through the node's lockd/rpc.statd (NLM); without them the kernel says ENOLCK.
                raise OSError(error.errno, f"{path}: the file system refuses record locks ({error.strerror}); on "
                              "NFSv3 the node needs rpc.statd running, or mount with NFSv4") from None
            yield
        finally:
            os.close(descriptor)  # releases the record lock
    finally:
        guard.release()
