"""Reading a job's ``domino pretrain`` arguments on the launching machine: single flags, or all of them parsed
with the config flags ``domino pretrain`` itself uses (so a typo fails here, not in a pod)."""

from __future__ import annotations

import argparse
from typing import List, Optional

from domino.config import add_config_flags
from domino.config.flags import ArgumentParser
from domino.launch.spec import LaunchSpecError

#: Flags ``domino pretrain`` takes besides the config flags.
PRETRAIN_EXTRA_FLAGS = ("--result-json",)


def has_flag(args: List[str], flag: str) -> bool:
    """Whether ``flag`` (``flag V`` or ``flag=V``) is among ``args``."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: List[str], flag: str) -> Optional[str]:
    """The value of the last ``flag V`` or ``flag=V`` in ``args`` (argparse keeps the last), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


class _RaisingParser(ArgumentParser):
    def error(self, message: str):  # argparse would print and exit; the launcher reports instead
        raise LaunchSpecError(f"domino pretrain arguments: {message}")


def parse_pretrain_args(args: List[str]) -> argparse.Namespace:
    """``args`` parsed as ``domino pretrain`` parses them (flags not given are absent from the namespace);
    raises :class:`LaunchSpecError` on an unknown flag or a bad value."""
    parser = _RaisingParser(prog="domino pretrain", add_help=False)
    add_config_flags(parser)
    for flag in PRETRAIN_EXTRA_FLAGS:
        parser.add_argument(flag)
    return parser.parse_args(list(args))
