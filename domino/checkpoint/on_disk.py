"""The domino checkpoint format on disk: the save root, ``latest`` and ``checkpoint.json``.

A save root ``DIR`` holds ``DIR/latest`` (a text file naming the newest checkpoint, e.g. ``iter_0000100``,
replaced last by an atomic rename) and one directory per checkpoint::

    DIR/iter_0000100/
        checkpoint.json              format version, iteration, TP size, padded vocab, tokenizer, config
        model/                       the weights, one safetensors file per TP rank (and pipeline stage):
                                     ``domino.checkpoint.model_shards``
        tokenizer/                   optional: the tokenizer, so the checkpoint is self-contained
        optimizer/                   the optimizer state by parameter name (``domino.checkpoint.distributed_io``)
        rng/                         each rank's RNG streams (``domino.checkpoint.per_rank_state``)

Nothing is unpickled to read a checkpoint back (safetensors, JSON, DCP). Every file is written to a
temporary name, fsynced and renamed, so an interrupted save never leaves a half-written file under the
final name.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Union

from domino.atomic_files import atomic_write_text
from domino.config import ConfigError, config_from_dict
from domino.config.bounds import bound_problems

#: Version 2 stores the optimizer state by parameter name (``optimizer/``, any layout reads it); version 1 kept
#: each rank's optimizer state (``optim/rank_NNNNN.pt``, read on the layout that wrote it). Both are read.
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
LATEST_FILE = "latest"
META_FILE = "checkpoint.json"
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
LEGACY_OPTIMIZER_DIR = "optim"
RNG_DIR = "rng"
TOKENIZER_DIR = "tokenizer"
#: ``checkpoint.json`` holds a config and a few numbers (a few kB); anything far larger is not one.
MAX_META_BYTES = 16 << 20
#: How many files (one per pipeline stage that wrote its own layers) hold each TP rank's weights; absent: 1.
MODEL_STAGES_KEY = "model_stages"
REQUIRED_META_KEYS = ("format_version", "iteration", "consumed_samples", "tensor_model_parallel_size",
                      "padded_vocab_size", "tokenizer", "config")
_TAG_PATTERN = re.compile(r"^iter_\d{7,}$")

PathLike = Union[str, os.PathLike]


class CheckpointError(ConfigError):
    """A checkpoint path or file that cannot be used; the message names the path and what is wrong."""


def checkpoint_tag(iteration: int) -> str:
    """The directory name of the checkpoint of ``iteration``: ``iter_0000100``."""
    return f"iter_{iteration:07d}"


#: A tensor name that may become a file name: no separator, not ``.`` or ``..``, nothing hidden, at most 200
#: characters (with ``.safetensors``, within the 255 bytes of a file name on Linux file systems).
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")


def check_file_name(name: str, source: str) -> str:
    """``name`` (read from an untrusted header) when it can be a file name inside its directory.

    Raises:
        CheckpointError: naming ``source`` and the name, before anything is written.
    """
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
        raise CheckpointError(f"{source}: tensor name {str(name)[:80]!r} cannot be a file name (letters, digits, "
                              "'_', '.' and '-' only, not starting with '.', at most 200): nothing written")
    return name


def tag_iteration(name: str) -> Optional[int]:
    """The iteration of a checkpoint directory name (``iter_0000100`` -> 100); None for any other name.

    Order checkpoints by it, never by name: past 10^7 iterations the tag has eight digits and sorts before
    ``iter_9999999`` as a string.
    """
    return int(name[5:]) if _TAG_PATTERN.match(name) else None


def write_latest(save_root: PathLike, tag: str) -> None:
    """Points ``save_root/latest`` at checkpoint ``tag`` (atomically; call after the checkpoint is complete)."""
    if not _TAG_PATTERN.match(tag):
        raise CheckpointError(f"checkpoint tag {tag!r} is not of the form iter_NNNNNNN")
    atomic_write_text(str(Path(save_root) / LATEST_FILE), tag + "\n")


def find_latest_checkpoint(save_root: PathLike) -> Optional[Path]:
    """The checkpoint ``save_root/latest`` points at, or ``None`` when the root holds no ``latest`` file.

    Raises:
        CheckpointError: when ``latest`` exists but is garbage or points at no checkpoint.
    """
    target = read_latest(save_root)
    if target is not None and not (target / META_FILE).is_file():
        raise CheckpointError(f"{Path(save_root) / LATEST_FILE} points at {target.name}, but "
                              f"{target / META_FILE} does not exist")
    return target


def read_latest(save_root: PathLike) -> Optional[Path]:
    """The directory ``save_root/latest`` names (complete or not), or ``None`` when there is no ``latest``.

    Raises:
        CheckpointError: when ``latest`` does not hold a tag like ``iter_0000100``.
    """
    latest = Path(save_root) / LATEST_FILE
    if not latest.is_file():
        return None
    tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    if not _TAG_PATTERN.match(tag):
        raise CheckpointError(f"{latest} should name a checkpoint like iter_0000100, but holds {tag[:60]!r}")
    return Path(save_root) / tag


def resolve_checkpoint_dir(path: PathLike) -> Path:
    """The checkpoint directory that ``path`` designates.

    Args:
        path: a save root holding ``latest``, or one checkpoint directory (``.../iter_0000100``).

    Raises:
        CheckpointError: when ``path`` is missing, is a file, is neither kind of directory, or its
            ``latest`` is garbage or points nowhere.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} is a file; expected a save root or an iter_* directory")
    if (p / META_FILE).is_file():
        return p
    found = find_latest_checkpoint(p)
    if found is None:
        raise CheckpointError(
            f"{p} is not a checkpoint: it has neither {META_FILE} (a checkpoint directory) "
            f"nor a '{LATEST_FILE}' file (a save root)")
    return found


def _check_meta(meta: Dict[str, Any], source: str) -> None:
    if not isinstance(meta, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(meta).__name__}")
    missing = [k for k in REQUIRED_META_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"{source}: missing field(s) {', '.join(missing)}")
    if meta["format_version"] not in READABLE_FORMAT_VERSIONS:
        raise CheckpointError(f"{source}: format_version {meta['format_version']!r} is not supported "
                              f"(this domino reads versions {', '.join(map(str, READABLE_FORMAT_VERSIONS))})")
    for key in ("iteration", "consumed_samples", "tensor_model_parallel_size", "padded_vocab_size"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise CheckpointError(f"{source}: field {key} must be a non-negative integer, got {meta[key]!r}")
    if meta["tensor_model_parallel_size"] < 1:
        raise CheckpointError(f"{source}: tensor_model_parallel_size must be >= 1")
    stages = meta.get(MODEL_STAGES_KEY, 1)
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise CheckpointError(f"{source}: field {MODEL_STAGES_KEY} must be a positive integer, got {stages!r}")
    if not isinstance(meta["config"], dict):
        raise CheckpointError(f"{source}: field config must be an object")
    try:  # untrusted: every field typed and bounded before a reader sizes a tensor or divides by it
        problems = bound_problems(config_from_dict(meta["config"]))
    except ConfigError as error:
        problems = [str(error)]
    if problems:
        raise CheckpointError(f"{source}: config: {'; '.join(problems)}")


def read_checkpoint_meta(ckpt_dir: PathLike) -> Dict[str, Any]:
    """Reads and checks ``ckpt_dir/checkpoint.json``.

    Raises:
        CheckpointError: when the file is missing, is not JSON, lacks a required field, or its iteration is not
            the one of its ``iter_*`` folder.
    """
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist (is {ckpt_dir} a checkpoint directory?)")
    if path.stat().st_size > MAX_META_BYTES:  # untrusted: bounded before it is read
        raise CheckpointError(f"{path} has {path.stat().st_size} bytes; checkpoint metadata is at most "
                              f"{MAX_META_BYTES} bytes")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    _check_meta(meta, str(path))
    named = tag_iteration(Path(ckpt_dir).name)
    if named is not None and named != meta["iteration"]:  # a resume would count from a step never saved here
        raise CheckpointError(f"{path}: iteration {meta['iteration']} disagrees with its folder's name "
                              f"{Path(ckpt_dir).name}")
    return meta


def write_checkpoint_meta(ckpt_dir: PathLike, meta: Dict[str, Any]) -> None:
    """Checks ``meta`` and writes it as ``ckpt_dir/checkpoint.json`` (atomically)."""
    meta = {"format_version": FORMAT_VERSION, **meta}
    _check_meta(meta, f"checkpoint metadata for {ckpt_dir}")
    atomic_write_text(str(Path(ckpt_dir) / META_FILE), json.dumps(meta, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint directory and its ``checkpoint.json``, checked once and passed along from discovery to the
    shard readers (nothing downstream reads the file again).

    Attributes:
        path: the ``iter_*`` directory.
        meta: its checked ``checkpoint.json``.
    """

    path: Path
    meta: Dict[str, Any]

    @classmethod
    def read(cls, ckpt_dir: PathLike) -> "Checkpoint":
        """The checkpoint directory ``ckpt_dir`` (its metadata read and checked, :func:`read_checkpoint_meta`)."""
        return cls(Path(ckpt_dir), read_checkpoint_meta(ckpt_dir))

    @classmethod
    def open(cls, path: "Union[PathLike, Checkpoint]") -> "Checkpoint":
        """The checkpoint ``path`` designates: a save root (its ``latest``), an ``iter_*`` directory, or one
        already read."""
        return path if isinstance(path, Checkpoint) else cls.read(resolve_checkpoint_dir(path))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def tensor_model_parallel_size(self) -> int:
        return self.meta["tensor_model_parallel_size"]

    @property
    def optimizer_format(self) -> Optional[str]:
        """How the optimizer state is stored: ``"by-name"`` (any layout reads it), ``"per-rank"`` (format 1: the
        layout that wrote it), or ``None`` (weights only: ``import-hf`` output)."""
        recorded = self.meta.get("optimizer")
        if isinstance(recorded, dict) and recorded.get("format") in ("by-name", "per-rank"):
            return recorded["format"]
        return "per-rank" if (self.path / LEGACY_OPTIMIZER_DIR).is_dir() else None

    def __str__(self) -> str:
        return str(self.path)


CheckpointLike = Union[PathLike, Checkpoint]
