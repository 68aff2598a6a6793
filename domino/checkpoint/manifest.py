"""Checkpoint manifests: the size and CRC-32 of every file a checkpoint holds, checked before it is used.

A checkpoint directory ends up with ``manifest.json``::

    {"format_version": 1, "files": {"model/tp_rank_00.safetensors": {"size": 123, "crc32": 305419896}, ...}}

While saving, every rank digests the files it wrote (reading them back, so a write the disk garbled is
caught too) into ``.manifest-parts/rank_NNNNN.json``; rank 0 then seals the checkpoint: it digests the files
no part lists (``checkpoint.json``, the tokenizer), writes ``manifest.json`` atomically and removes the parts,
before the directory is renamed into place. So a checkpoint under its final name always has a complete
manifest, unless it was written by a domino that had none (then it is used unverified, with a log line).

Two checks, by cost:

* :func:`find_damage` (sizes and presence; no data read): cheap enough to run on every rank when choosing
  which checkpoint to resume, and every rank reaches the same answer from the same shared volume.
* :func:`verify` (CRC-32 of the named files): each rank verifies only the files it is about to read.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Dict, Iterable, Optional, Union

from domino.atomic_files import atomic_write_text

MANIFEST_FILE = "manifest.json"
PARTS_DIR = ".manifest-parts"
FORMAT_VERSION = 1
_BLOCK = 8 << 20
#: About 80 bytes per file: room for hundreds of thousands of files.
MAX_MANIFEST_BYTES = 64 << 20

PathLike = Union[str, os.PathLike]
Digest = Dict[str, int]


def digest(path: PathLike) -> Digest:
    """``{"size": bytes, "crc32": checksum}`` of a file, read in 8 MiB blocks (flat memory)."""
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"size": size, "crc32": crc}


def write_part(ckpt_dir: PathLike, rank: int, files: Iterable[PathLike]) -> None:
    """Records the digests of the files this rank wrote into ``ckpt_dir`` (call before the save's barrier)."""
    root = Path(ckpt_dir)
    entries = {Path(f).relative_to(root).as_posix(): digest(f) for f in files}
    atomic_write_text(str(root / PARTS_DIR / f"rank_{rank:05d}.json"), json.dumps(entries, sort_keys=True))


def seal(ckpt_dir: PathLike) -> None:
    """Writes ``manifest.json`` from the ranks' parts plus a digest of every file no part lists (rank 0 only)."""
    root = Path(ckpt_dir)
    files: Dict[str, Digest] = {}
    parts = root / PARTS_DIR
    for part in sorted(parts.glob("rank_*.json")) if parts.is_dir() else ():
        files.update(json.loads(part.read_text()))
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_file() and name not in files and name != MANIFEST_FILE and not name.startswith(PARTS_DIR):
            files[name] = digest(path)
    atomic_write_text(str(root / MANIFEST_FILE),
                      json.dumps({"format_version": FORMAT_VERSION, "files": files}, indent=1, sort_keys=True))
    for part in parts.glob("*") if parts.is_dir() else ():
        part.unlink()
    if parts.is_dir():
        parts.rmdir()


def read_manifest(ckpt_dir: PathLike) -> Optional[Dict[str, Digest]]:
    """The ``files`` table of a checkpoint's manifest; ``None`` when the checkpoint has no manifest.

    Raises:
        ValueError: when ``manifest.json`` exists but is not a manifest (the message names the file).
    """
    path = Path(ckpt_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_MANIFEST_BYTES:  # untrusted: bounded before it is read
        raise ValueError(f"{path} is not a checkpoint manifest ({path.stat().st_size} bytes; at most "
                         f"{MAX_MANIFEST_BYTES})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if data.get("format_version") != FORMAT_VERSION or not isinstance(files, dict):
            raise ValueError("unknown layout")
        for name, entry in files.items():
            if (".." in Path(name).parts or Path(name).is_absolute()
                    or not all(isinstance(entry.get(k), int) for k in ("size", "crc32"))):
                raise ValueError(f"bad entry {name!r}")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a checkpoint manifest ({error})") from None
    return files


def find_damage(ckpt_dir: PathLike) -> Optional[str]:
    """Why a checkpoint cannot be used, judged by presence and sizes only; ``None`` when it looks intact."""
    try:
        files = read_manifest(ckpt_dir)
    except ValueError as error:
        return str(error)
    for name, entry in (files or {}).items():
        path = Path(ckpt_dir) / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path} has {size} bytes, the manifest says {entry['size']}"
    return None


def verify(ckpt_dir: PathLike, names: Iterable[str]) -> Optional[str]:
    """Why the named files of a checkpoint are damaged (size or CRC-32 differs); ``None`` when they match.

    Files the manifest does not list, and checkpoints without a manifest, are not judged here.
    """
    try:
        files = read_manifest(ckpt_dir)
    except ValueError as error:
        return str(error)
    if files is None:
        return None
    for name in names:
        expected = files.get(name)
        if expected is None:
            continue
        path = Path(ckpt_dir) / name
        if not path.is_file():
            return f"{path} is missing"
        actual = digest(path)
        if actual != expected:
            return (f"{path} is damaged (size {actual['size']}, crc32 {actual['crc32']:08x}; the manifest says "
                    f"size {expected['size']}, crc32 {expected['crc32']:08x})")
    return None
