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
from typing import List, NoReturn, Optional, Sequence

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


def build_parser() -> argparse.ArgumentParser:
    """The full ``domino`` argument parser with every registered sub-command (no abbreviated flags anywhere)."""
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
    for name in VERB_MODULES:
        importlib.import_module(f"domino.cli.{name}").register(subparsers)
    return parser


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
    parser = build_parser()
    args = parser.parse_args(argv)
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
