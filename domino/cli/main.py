"""Entry point of the ``domino`` command: builds one sub-command per verb module and dispatches.

Each verb module in :data:`VERB_MODULES` exposes ``register(subparsers)``, which adds its
sub-command(s) and sets ``func`` (a callable taking the parsed namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import List, NoReturn, Optional, Sequence, Tuple

from domino import __version__
from domino.config import ConfigError
from domino.config.flags import ArgumentParser
from domino.logging_utils import setup_logging

#: Modules under ``domino.cli`` that register sub-commands, in ``--help`` order.
VERB_MODULES: List[str] = [
    "data",
    "pretrain",
    "evaluate",
    "generate",
    "hf",
    "report",
    "goodput",
    "checkpoint",
    "estimate",
    "launch",
    "pipeline",
]


#: The verb modules that register one sub-command, of their own name (``data`` and ``hf`` register others):
#: ``domino NAME ...`` needs that module's parser alone (tests/test_cli_parser_per_verb.py checks the set).
SELF_NAMED_VERBS = frozenset(VERB_MODULES) - {"data", "hf"}
#: The root's flags that take a value (see :func:`build_parser`): what may come before the sub-command.
_ROOT_FLAGS_WITH_VALUE = ("--log-level", "--local_rank", "--local-rank")


def build_parser(verbs: Sequence[str] = tuple(VERB_MODULES)) -> argparse.ArgumentParser:
    """The ``domino`` argument parser with the sub-commands of the verb modules ``verbs`` (default: every one);
    no abbreviated flags anywhere."""
    parser = ArgumentParser(
        prog="domino",
        description="GPT pretraining with Domino tensor parallelism, DeepSpeed and Kubeflow Pipelines.",
    )
    parser.add_argument("--version", action="version", version=f"domino {__version__}")
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default: INFO).")
    # `deepspeed --module domino pretrain ...` runs `python -m domino --local_rank=N pretrain ...`
    # (deepspeed/launcher/launch.py); the rank is also in LOCAL_RANK, which is what domino reads.
    parser.add_argument("--local_rank", "--local-rank", dest="launcher_local_rank", type=int, default=None,
                        help="Set by the deepspeed launcher; ignored (LOCAL_RANK is read from the environment).")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in verbs:
        importlib.import_module(f"domino.cli.{name}").register(subparsers)
    return parser


def verbs_for(argv: Sequence[str]) -> Tuple[str, ...]:
    """The verb modules whose parsers ``argv`` needs: only its sub-command's when that is a self-named verb's,
    else every one (``--help``, ``--version``, a mistyped command: the root's own answers list them all).

    Every rank of a run parses its command line as it starts (again after each preemption); the other verbs'
    modules (the launchers, evaluation, the kfp layer's flags) and their parsers cost it 0.1-0.2 s and are
    never used.
    """
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        if argv[index].startswith(tuple(f + "=" for f in _ROOT_FLAGS_WITH_VALUE)):
            index += 1
        elif (argv[index] in _ROOT_FLAGS_WITH_VALUE and index + 1 < len(argv)
              and not argv[index + 1].startswith("-")):
            index += 2
        else:  # --help, --version, a flag without its value: the whole parser answers, as before
            return tuple(VERB_MODULES)
    command = argv[index] if index < len(argv) else None
    return (command,) if command in SELF_NAMED_VERBS else tuple(VERB_MODULES)


def leave_process(code: int) -> NoReturn:
    """Ends a process that ran ``torch.distributed``: streams flushed, no interpreter finalization.

    Gloo's worker threads drop their reference to a finished collective (and with it the tensors, which
    takes the GIL) only after the waiting rank has moved on (``ProcessGroupGloo::runLoop`` resets
    ``workInProgress_`` after ``execute``, torch/csrc/distributed/c10d/ProcessGroupGloo.cpp). If that happens
    while CPython finalizes, the thread is ended inside torch's C++ frames and the whole process aborts after
    a run that succeeded: "terminate called without an active exception", SIGABRT (pytorch/pytorch#190489;
    seen in our CI under load, core dump in ``~AsyncAllgatherWork`` from ``runLoop``). Destroying the process
    groups would join those threads, but DeepSpeed's engine, optimizer and parameters keep the groups alive.
    Everything domino writes is closed (checkpoints fsynced) before a verb returns, so nothing is lost here.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
    os._exit(code)


def _ran_torch_distributed() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs ``domino`` with ``argv`` (default: ``sys.argv[1:]``) and exits with the verb's status.

    Called without ``argv`` it owns the process: after a verb that ran ``torch.distributed`` it leaves
    through :func:`leave_process`, also after an unexpected error (traceback printed, status 1, as Python
    itself would). Called with ``argv`` (in-process, as the tests do) it raises ``SystemExit``.
    """
    words = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(verbs_for(words)).parse_args(words)
    setup_logging(args.log_level)
    try:
        code = args.func(args)
    except ConfigError as error:  # one line, as argparse reports a bad flag (not logged as well)
        print(f"domino {args.command}: error: {error}", file=sys.stderr)
        code = getattr(error, "exit_code", 2)  # 2: fix the input; a lost peer says 128 (retryable)
    except BrokenPipeError:  # the reader (`| head`) closed the pipe: stop quietly, as the Python docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # what a shell reports for SIGPIPE
    except Exception:
        if argv is not None or not _ran_torch_distributed():
            raise
        traceback.print_exc()  # what Python prints for an uncaught exception; then leave without finalizing
        code = 1
    if argv is None and _ran_torch_distributed():
        leave_process(code or 0)
    sys.exit(code or 0)
