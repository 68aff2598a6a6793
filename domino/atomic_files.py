"""Atomic file output: write under a temporary name, fsync, then rename over the final name.

A reader never sees a half-written file under the final name: either the old file, no file, or the
complete new one. Every layer writes through here: datasets and their index cache, tokenizer files,
checkpoint shards and metadata, the promotion registry, reports and rendered manifests.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import IO, Iterator


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


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """Opens a temporary file for writing; on success it replaces ``path``, on error it is deleted.

    Example::

        with atomic_write("out.json", "w") as f:
            f.write("{}")
    """
    temporary = temporary_name(path)
    try:
        with open(temporary, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        fsync_directory(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        remove_quietly(temporary)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically, creating the parent directory if needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(str(path), "w") as handle:
        handle.write(text)
