"""Atomic file output: write under a temporary name, fsync, then rename over the final name.

A reader never sees a half-written file under the final name: either the old file, no file, or the
complete new one. Every layer writes through here: datasets and their index cache, tokenizer files,
checkpoint shards and metadata, the promotion registry, reports and rendered manifests.

A writer holds a record lock on its temporary (:func:`open_owned_temporary`) until the rename, so that a
process killed mid-write (SIGKILL, OOM) leaves a temporary that no live process owns, and
:func:`sweep_temporaries` can remove exactly those: a record lock is released by the kernel when its
process dies (fcntl(2); on NFS the server does it, see :mod:`domino.file_lock`). On a file system without
record locks the temporary is written unowned and never swept.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import uuid
from typing import IO, Iterator, List, Optional, Sequence, Set, Tuple

from domino.file_lock import NO_LOCKS, try_lock_descriptor

logger = logging.getLogger(__name__)


def temporary_name(path: str) -> str:
    """A unique sibling of ``path`` (same directory, so the final rename stays on one file system)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_directory(directory: str) -> None:
    """Makes a rename inside ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(temporary: str, final: str) -> None:
    """fsyncs ``temporary`` and renames it to ``final`` (replacing it), then fsyncs the directory."""
    with open(temporary, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, final)
    fsync_directory(os.path.dirname(os.path.abspath(final)))


def remove_quietly(path: str) -> None:
    """Deletes ``path`` if it exists."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _lock(descriptor: int) -> Optional[bool]:
    """A record lock without waiting: True taken, False held by another process, None not supported here."""
    try:
        return try_lock_descriptor(descriptor)
    except OSError as error:
        if error.errno in NO_LOCKS:
            return None
        raise


def open_owned_temporary(path: str, mode: str = "wb") -> Tuple[str, IO]:
    """Creates a new temporary sibling of ``path`` and opens it, record-locked by this process.

    Keep the handle open until the temporary is renamed: closing *any* descriptor of the file releases the
    process's lock (fcntl(2)), so reopen it for nothing else (fsync through this handle).

    Returns:
        ``(temporary path, open handle)``.
    """
    for _ in range(8):
        temporary = temporary_name(path)
        handle = open(temporary, mode.replace("w", "x", 1))  # a new file: never someone else's
        locked = _lock(handle.fileno())
        try:
            ours = os.stat(temporary).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:  # a sweep took it between our create and our lock
            ours = False
        if ours and locked is not False:
            return temporary, handle
        handle.close()  # a sweep holds it and is deleting it: take another name
    raise OSError(f"{path}: could not create a temporary file of our own")


def _open_files() -> Optional[Set[Tuple[int, int]]]:
    """(device, inode) of every file this process has open (``/proc/self/fd``, else ``/dev/fd``), or None
    where neither lists them."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found = set()
        for name in names:
            with contextlib.suppress(OSError, ValueError):  # the listing's own descriptor is gone by now
                status = os.fstat(int(name))
                found.add((status.st_dev, status.st_ino))
        return found
    return None


def sweep_temporaries(paths: Sequence[str]) -> List[str]:
    """Deletes the temporaries of ``paths`` (``.<name>.tmp-*`` beside each) that no live writer owns.

    A temporary is removed only when this process can take its record lock (its writer is gone) and it is
    still the file we locked; a file this process has open is never touched (its own lock would not stop
    us, and closing our descriptor would drop it). That is asked of the open descriptors, not read from the
    name's pid: pods have pid namespaces of their own, so a retried step's process often has the pid of
    the killed one whose temporaries it finds. Returns the removed paths.
    """
    removed = []
    for path in paths:
        directory, base = os.path.split(os.path.abspath(path))
        candidates = sorted(glob.glob(os.path.join(glob.escape(directory), glob.escape(f".{base}.tmp-") + "*")))
        # Listed after the glob: a temporary of a live thread of ours was created with its descriptor open.
        mine = _open_files()
        if mine is None:  # our own temporaries cannot be told from the others': leave them all
            continue
        for temporary in candidates:
            try:
                status = os.stat(temporary)
            except OSError:
                continue
            if (status.st_dev, status.st_ino) in mine:
                continue
            try:
                descriptor = os.open(temporary, os.O_RDWR)
            except OSError:
                continue
            try:
                if _lock(descriptor) and os.stat(temporary).st_ino == os.fstat(descriptor).st_ino:
                    os.remove(temporary)
                    removed.append(temporary)
            except FileNotFoundError:
                pass
            finally:
                os.close(descriptor)
    if removed:
        logger.warning("removed %d temporary file(s) left by killed writers: %s", len(removed), ", ".join(removed))
    return removed


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """Opens a temporary file for writing; on success it replaces ``path``, on error it is deleted.

    Example::

        with atomic_write("out.json", "w") as f:
            f.write("{}")
    """
    temporary, handle = open_owned_temporary(path, mode)
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
            os.replace(temporary, path)  # still open, so still owned: a sweep cannot take it before this
        fsync_directory(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        remove_quietly(temporary)
        raise


def staging_directory(final: str) -> str:
    """A new hidden directory beside ``final`` to fill and then rename to it, with the umask's permissions.

    ``tempfile.mkdtemp`` creates its directory with mode 0700 (it is private until published); a folder
    published by renaming it would keep that mode, and other users of a shared volume could not read it.
    """
    import tempfile

    directory = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(final))}.",
                                 dir=os.path.dirname(os.path.abspath(final)))
    umask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    return directory


def atomic_write_text(path: str, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically, creating the parent directory if needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(str(path), "w") as handle:
        handle.write(text)
