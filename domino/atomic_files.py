"""Atomic file output: write under a temporary name, fsync, then rename over the final name.

A reader never sees a half-written file under the final name: either the old file, no file, or the
complete new one. Every layer writes through here: datasets and their index cache, tokenizer files,
checkpoint shards and metadata, the promotion registry, reports and rendered manifests.

A writer holds a record lock on its temporary (:func:`open_owned_temporary`) until the rename, so that a
process killed mid-write (SIGKILL, OOM) leaves a temporary that no live process owns, and
:func:`sweep_temporaries` can remove exactly those: a record lock is released by the kernel when its
process dies (fcntl(2); on NFS the server does it, see :mod:`domino.file_lock`). On a file system without
record locks the temporary is written unowned and never swept.

Folders published whole (``export-hf``, ``import-hf``) are filled in a :class:`StagingDirectory` beside their
final name, owned the same way through a locked ``.staging-owner`` file inside it; the next staging directory
for the same name removes those whose writer is gone.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import shutil
import uuid
from typing import IO, Callable, Iterator, List, Optional, Sequence, Set, Tuple

from domino.file_lock import NO_LOCKS, try_lock_descriptor

logger = logging.getLogger(__name__)


def temporary_name(path: str) -> str:
    """A unique sibling of ``path`` (same directory, so the final rename stays on one file system)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


#: Bytes the longest name derived from a final name adds to it: ``temporary_name``'s ``.`` + ``.tmp-`` + a pid (up to
#: 7 digits, the kernel's largest pid_max) + ``-`` + 8 hex; a staging or replaced folder adds fewer.
DERIVED_NAME_EXTRA = 1 + 5 + 7 + 1 + 8


def name_too_long(path: str) -> Optional[str]:
    """Why ``path`` cannot be written here, with the temporary name its writer gives it beside it, when its
    file name is too long for the file system (checked before any work: the write fails with ``File name too
    long`` only at the end otherwise); None when it fits."""
    directory = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)  # the nearest folder that exists decides the file system
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255  # NAME_MAX of Linux's file systems (limits.h)
    size = len(os.fsencode(os.path.basename(path)))
    if size + DERIVED_NAME_EXTRA <= limit:
        return None
    return (f"its file name has {size} bytes; with the {DERIVED_NAME_EXTRA} its temporary name adds, that is over the "
            f"{limit} bytes a name may have here (at most {limit - DERIVED_NAME_EXTRA})")


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
    """Deletes the temporaries of ``paths`` (``.<name>.tmp-*`` beside each) that no live writer owns
    (:func:`remove_orphan`). Returns the removed paths."""
    removed = []
    for path in paths:
        directory, base = os.path.split(os.path.abspath(path))
        for temporary in sorted(glob.glob(os.path.join(glob.escape(directory), glob.escape(f".{base}.tmp-") + "*"))):
            if remove_orphan(temporary, functools.partial(os.remove, temporary)):
                removed.append(temporary)
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


def process_umask() -> int:
    """The process's umask, read from ``Umask:`` in ``/proc/self/status`` (Linux 4.7 and later, proc(5)), since
    ``os.umask`` reads it only by setting it, for every thread at once (an asynchronous save's writer among
    them); elsewhere set to 077 for that instant, so a file another thread creates meanwhile is private, not
    open to all."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def follow_umask(path: str, bits: int = 0o666) -> None:
    """Gives ``path`` the mode that ``open`` (``bits`` 0o666) or ``mkdir`` (0o777) gives under the umask, for
    files and folders made private by their writer (``tempfile``, safetensors) and then published."""
    os.chmod(path, bits & ~process_umask())


def remove_orphan(owner: str, remove: Callable[[], None]) -> bool:
    """Runs ``remove`` when the process that created and record-locked the file ``owner`` is gone: the file
    exists, this process does not have it open (its own lock would not stop us, and closing our descriptor would
    drop it), no other process holds its lock, and it is still the file we locked. ``remove`` runs while we hold
    the lock, so a writer that has just created ``owner`` and not yet locked it finds its lock taken and starts
    over. Returns whether it ran; never where the file system has no record locks or this process's open files
    cannot be listed.

    That is asked of the lock, not read from a pid in a name: pods have pid namespaces of their own, so a
    retried step's process often has the pid of the killed one whose files it finds.
    """
    mine = _open_files()
    try:
        status = os.stat(owner)
    except OSError:  # no owner file (published, or not created yet): not provably an orphan
        return False
    if mine is None or (status.st_dev, status.st_ino) in mine:
        return False
    try:
        descriptor = os.open(owner, os.O_RDWR)
    except OSError:
        return False
    try:
        if _lock(descriptor) and os.stat(owner).st_ino == os.fstat(descriptor).st_ino:
            remove()
            return True
        return False
    except FileNotFoundError:
        return False
    finally:
        os.close(descriptor)


#: The file that a staging directory's writer keeps record-locked while it fills the directory.
STAGING_OWNER = ".staging-owner"


class StagingDirectory:
    """A new hidden directory beside ``final`` (``.<name>.XXXXXXXX``) to fill and then rename to it, with the
    umask's permissions, owned by this process until :meth:`close`.

    ``tempfile.mkdtemp`` creates its directory with mode 0700 (it is private until published); a folder
    published by renaming it would keep that mode, and other users of a shared volume could not read it.

    A writer killed before publishing (SIGKILL, the OOM killer) leaves the directory, as large as the output;
    creating the next staging directory for the same ``final`` removes every one whose ``.staging-owner`` no
    live process holds (:func:`remove_orphan`). One without an owner file (published, or killed in the instant
    between giving it up and the rename) is never touched, nor anything else beside ``final``.

    Example::

        with StagingDirectory(output) as staging:
            write_into(staging.path)
            staging.publish(lambda: os.rename(staging.path, output))
    """

    def __init__(self, final: str) -> None:
        import tempfile

        final = os.path.abspath(final)
        sweep_staging(final)
        for _ in range(8):
            self.path = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", dir=os.path.dirname(final))
            follow_umask(self.path, 0o777)
            self._owner_path = os.path.join(self.path, STAGING_OWNER)
            self._owner: Optional[int] = os.open(self._owner_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            locked = _lock(self._owner)  # None: no record locks here, and so never swept
            try:
                ours = os.stat(self._owner_path).st_ino == os.fstat(self._owner).st_ino
            except FileNotFoundError:  # another run's sweep took it between our create and our lock
                ours = False
            if ours and locked is not False:
                return
            self.close()
        raise OSError(f"{final}: could not create a staging directory of our own")

    def publish(self, move: Callable[[], None]) -> None:
        """Removes the owner file (it is not part of the output) and runs ``move``, which renames the
        directory into place; the lock is held until :meth:`close`, so no sweep starts in between."""
        remove_quietly(self._owner_path)
        move()

    def close(self) -> None:
        """Deletes what is left of the directory (nothing once published), then releases the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None

    def __enter__(self) -> "StagingDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sweep_staging(final: str) -> List[str]:
    """Removes the staging directories of ``final`` whose writer is gone; returns their paths."""
    directory, base = os.path.split(os.path.abspath(final))
    removed = []
    for candidate in sorted(glob.glob(os.path.join(glob.escape(directory), glob.escape(f".{base}.") + "*"))):
        if (os.path.isdir(candidate) and not os.path.islink(candidate) and remove_orphan(
                os.path.join(candidate, STAGING_OWNER), functools.partial(shutil.rmtree, candidate, True))):
            removed.append(candidate)
    if removed:
        logger.warning("removed %d staging folder(s) of killed writers of %s: %s", len(removed), final,
                       ", ".join(removed))
    return removed


def atomic_write_text(path: str, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically, creating the parent directory if needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(str(path), "w") as handle:
        handle.write(text)
