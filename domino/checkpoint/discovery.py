"""Choosing the checkpoint a run starts from: its own, or ``--load``'s, intact, else the newest intact older one.

Every candidate is judged by its metadata, manifest and file sizes (no data read), so every rank reaches the same
answer from the same shared volume; the chosen one leaves here as an :class:`~domino.checkpoint.on_disk.Checkpoint`
(path and checked metadata), which :mod:`domino.checkpoint.resume` verifies and loads without reading
``checkpoint.json`` again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Tuple, Union

from domino.checkpoint import manifest, on_disk
from domino.checkpoint.on_disk import Checkpoint
from domino.config import ConfigError, DominoConfig

logger = logging.getLogger(__name__)


def find_checkpoint(config: DominoConfig) -> Tuple[Optional[Checkpoint], bool]:
    """The checkpoint to start from and whether to take its weights only (a warm start).

    The run's own checkpoint comes first: when ``--save`` already holds one (a restarted pod, a retried
    step, the same command run again), it is resumed whatever ``--load`` names, so a restart never throws
    progress away and never reloads another run's model over its own. Otherwise ``--load DIR`` resumes from
    ``DIR/latest`` (with ``--finetune``: takes its weights as a warm start); an absent or empty ``DIR``, or
    one holding only what a run writes beside its checkpoints (metrics, logs), means a fresh start. Without
    ``--load`` a run resumes ``--save``'s checkpoint when it holds one, with a line saying so, and starts fresh
    otherwise: ``--load`` defaults to ``--save``. Megatron-LM loads only with ``--load``
    (``megatron/training/training.py`` at 001b00c ``setup_model_and_optimizer``: ``if args.load is not None or
    args.pretrained_checkpoint is not None``), and its scripts resume by passing one directory to both
    (``examples/gpt3/train_gpt3_175b_distributed.sh`` at 157006d: ``--save $CHECKPOINT_PATH``,
    ``--load $CHECKPOINT_PATH``);
    ``domino launch`` and the pipeline pass ``--load`` = ``--save`` the same way (:func:`domino.launch.render.
    container_command`, ``components/pretrain/step.py`` ``load_argv``), so a run started by hand or with
    ``--command`` resumes too instead of training from 0 over its own checkpoints. Anything else that is not a
    readable checkpoint (a file, another kind of model) is a :class:`ConfigError`, raised before any training work.
    """
    c = config.checkpoint
    if c.load is None:
        own = _resolve(c.save, "--save", c.strict_load) if c.save else None
        if own is None:
            return None, False
        logger.warning("--save %s already holds checkpoints and no --load was given: resuming %s (--load "
                       "defaults to --save; to start from scratch, save elsewhere)", c.save, Path(str(own)).name)
        return choose_intact(own, c.strict_load), False
    if c.save and Path(c.save).resolve() != Path(c.load).resolve():
        own = _resolve(c.save, "--save", c.strict_load)
        if own is not None:
            logger.info("--save %s already holds this run's checkpoint %s: resuming it instead of %s --load %s",
                        c.save, Path(str(own)).name, "warm-starting from" if c.finetune else "loading", c.load)
            return choose_intact(own, c.strict_load), False
    found = _resolve(c.load, "--load", c.strict_load)
    return (choose_intact(found, c.strict_load) if found is not None else None), c.finetune


def own_checkpoint(config: DominoConfig, resumed: Optional[Checkpoint], warm_start: bool,
                   iteration: int) -> Optional[str]:
    """The checkpoint of ``iteration`` under ``--save`` that the run resumed (from ``resumed``'s folder), if any.

    The training loop does not save that iteration again (a restart after the last iteration saves nothing).
    """
    save = config.checkpoint.save
    if resumed is None or warm_start or not save:
        return None
    own = Path(save) / on_disk.checkpoint_tag(iteration)
    return str(own) if own.is_dir() and resumed.path.parent.resolve() == own.parent.resolve() else None


def _resolve(directory: str, flag: str, strict: bool = False) -> Union[None, Path, Checkpoint]:
    """The checkpoint ``directory`` names (not yet judged), one already judged intact, or ``None`` (none yet)."""
    path = Path(directory)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    if path.is_dir() and not (path / "latest").exists() and not (path / "checkpoint.json").exists():
        if any(checkpoints_below(path, None)):  # killed after the first rename in, before `latest` was written
            return _newest_complete(path, None, f"{flag} {directory} has no 'latest' file", strict)
        foreign = [p.name for p in path.iterdir() if _looks_like_a_model(p.name)]
        if not foreign:
            return None  # temporaries of a save that never completed, metrics or logs of a run not saved yet
        raise ConfigError(f"{flag} {directory}: not a domino checkpoint directory (no 'latest' file; found "
                          f"{', '.join(sorted(foreign)[:5])})")
    try:
        found = on_disk.resolve_checkpoint_dir(path)
    except (ValueError, OSError) as error:
        try:
            pointed = on_disk.read_latest(path)
        except ValueError:
            pointed = None
        if pointed is not None and pointed.is_dir():
            return pointed  # a torn checkpoint that `latest` names: choose_intact judges it and falls back
        if pointed is not None:  # killed while a checkpoint of the same iteration was being replaced
            return _newest_complete(path, pointed.name, f"{flag} {directory}: 'latest' names {pointed.name}, "
                                    "which does not exist", strict)
        raise ConfigError(f"{flag} {directory}: {error}") from error
    _report_newer(path, found)
    return found


def _report_newer(root: Path, named: Path) -> None:
    """Warns of checkpoints under their final names in save root ``root`` newer than ``named``, the one ``latest``
    names: their commit was cut short between the rename and ``latest`` (or they belong to another run's history).

    ``latest`` decides, as Megatron-LM's tracker file does (``megatron/training/checkpointing.py``: the iteration is
    read from ``latest_checkpointed_iteration.txt`` only): a ``latest`` moved back by hand leaves newer sealed
    checkpoints that must not be resumed, and a directory alone cannot tell those from an interrupted commit. The
    run replaces such a checkpoint when it saves that iteration again (the old one renamed aside and deleted last,
    :func:`checkpointing._commit`)."""
    if named.parent != root:
        return
    mine = on_disk.tag_iteration(named.name)
    newer = [p.name for p in checkpoints_below(root, None) if mine is not None
             and on_disk.tag_iteration(p.name) > mine and (p / manifest.MANIFEST_FILE).is_file()]
    if newer:
        logger.warning("%s: `latest` names %s, but newer sealed checkpoints exist: %s (a save killed between its "
                       "rename and `latest`, or another run's); resuming %s, as `latest` says (a save of the same "
                       "iteration replaces one)", root, named.name, ", ".join(newer), named.name)


#: Names that mark another kind of model (Hugging Face, Megatron-LM, torch files), not a run's metrics or logs.
_MODEL_FILES = ("config.json", "latest_checkpointed_iteration.txt")
_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _looks_like_a_model(name: str) -> bool:
    return name in _MODEL_FILES or name.endswith(_MODEL_SUFFIXES)


def checkpoints_below(root: Path, tag: Optional[str]):
    """The ``iter_*`` directories of ``root`` before ``tag`` (all of them for ``None``), newest first, ordered by
    number (:func:`~domino.checkpoint.on_disk.tag_iteration`)."""
    below = on_disk.tag_iteration(tag) if tag is not None else None
    found = [(on_disk.tag_iteration(p.name), p) for p in root.iterdir() if p.is_dir()]
    return [p for n, p in sorted((n, p) for n, p in found if n is not None and (below is None or n < below))[::-1]]


def _newest_complete(root: Path, below: Optional[str], problem: str, strict: bool) -> Checkpoint:
    """The newest intact checkpoint of ``root`` (before ``below``), when ``latest`` cannot be followed."""
    if strict:
        raise ConfigError(f"{problem} (--strict-load refuses to fall back)")
    for candidate in checkpoints_below(root, below):
        judged = _judge(candidate)
        if isinstance(judged, Checkpoint):
            logger.warning("%s: resuming from the newest complete checkpoint, %s (pass --strict-load to refuse "
                           "instead).", problem, candidate.name)
            return judged
    raise ConfigError(f"{problem}, and no complete checkpoint exists in {root}")


def _older_checkpoints(ckpt: Path):
    """The checkpoints beside ``ckpt`` with a lower iteration, newest first."""
    return checkpoints_below(ckpt.parent, ckpt.name)


def _judge(path: Path) -> Union[Checkpoint, str]:
    """``path`` as a :class:`Checkpoint` when it can be resumed, else why not, from its metadata, manifest and
    file sizes (no data read)."""
    try:
        ckpt = Checkpoint.read(path)
    except ValueError as error:
        return str(error)
    return manifest.find_damage(path) or ckpt


def fall_back(ckpt: Union[Path, Checkpoint], problem: str, strict: bool) -> Checkpoint:
    """The newest intact checkpoint older than the damaged ``ckpt``, or a ConfigError when there is none.

    Every rank reaches the same answer: the candidates and their sizes come from the same shared volume.
    """
    if strict:
        raise ConfigError(f"--load: checkpoint {ckpt} is damaged: {problem} (--strict-load refuses to fall back)")
    for older in _older_checkpoints(Path(str(ckpt))):
        judged = _judge(older)
        if isinstance(judged, Checkpoint):
            logger.warning("CHECKPOINT %s IS DAMAGED: %s. Resuming from the newest intact checkpoint, %s "
                           "(pass --strict-load to refuse instead).", ckpt, problem, older.name)
            return judged
    raise ConfigError(f"--load: checkpoint {ckpt} is damaged ({problem}) and no older intact checkpoint exists "
                      f"in {Path(str(ckpt)).parent}")


def choose_intact(ckpt: Union[Path, Checkpoint], strict: bool) -> Checkpoint:
    """``ckpt`` when its files are all present at their recorded sizes, else the newest intact older one."""
    judged = ckpt if isinstance(ckpt, Checkpoint) else _judge(ckpt)
    return judged if isinstance(judged, Checkpoint) else fall_back(ckpt, judged, strict)
