"""Every boolean flag of every ``domino`` verb, each spelling parsed by the real parser: a spelling that names
the flag's field (its help describes that field) sets True, its ``--no-`` negation sets False, and a field
that itself starts with ``no_`` (Megatron's ``--no-load-optim``) is set True by its own flag.

``argparse.BooleanOptionalAction`` gets the last case wrong: its ``__call__`` sets
``not option_string.startswith('--no-')`` (CPython 3.11 ``Lib/argparse.py``), so ``--no-load-optim`` parsed
to False and a resume told to take a fresh optimizer silently restored the old one.
"""

from __future__ import annotations

import argparse
from typing import Iterator, List, Tuple

from domino.cli.main import build_parser
from domino.config import parse_config
from domino.config.flags import FLAG_ALIASES

BOOLEAN_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def _verbs(parser: argparse.ArgumentParser, path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...],
                                                                                           argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _verbs(sub, (*path, name))


def _is_boolean(action: argparse.Action) -> bool:
    return action.nargs == 0 and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)) and (
        isinstance(action, BOOLEAN_ACTIONS) or type(action).__name__ == "BooleanFlag")


def _dummy(action: argparse.Action) -> List[str]:
    return [str(sorted(action.choices)[0])] if action.choices else ["1"]


def _required(parser: argparse.ArgumentParser, tested: argparse.Action) -> List[str]:
    """Values for the verb's required arguments (the tested flag alone would not parse)."""
    argv: List[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action is tested:
            continue
        if not action.option_strings and action.nargs not in ("?", "*", argparse.REMAINDER):
            argv += _dummy(action)
        elif action.option_strings and action.required:
            argv += [action.option_strings[0], *_dummy(action)]
    for group in parser._mutually_exclusive_groups:
        if group.required and tested not in group._group_actions:
            first = group._group_actions[0]
            argv += [first.option_strings[0], *([] if first.nargs == 0 else _dummy(first))]
    return argv


def _expected(action: argparse.Action, option: str) -> bool:
    """What the spelling means by its name: the field's name sets True, ``--no-`` + the field's name False."""
    field = action.dest.removeprefix("legacy_").replace("_", "-")  # LegacyFlag.dest: "legacy_" + the old flag
    if option == f"--{field}" or option in FLAG_ALIASES.get(action.dest, ()):
        return True
    aliases = FLAG_ALIASES.get(action.dest, ())
    if option == f"--no-{field}" or (field.startswith("no-") and option == f"--{field[3:]}") or option in {
            f"--no-{alias[2:]}" for alias in aliases}:  # an alias's negation (--no-override-opt_param-scheduler)
        return False
    raise AssertionError(f"{option} (field {action.dest}) names neither its field nor the field's negation")


def _cases():
    for path, parser in _verbs(build_parser()):
        for action in parser._actions:
            if _is_boolean(action) and action.dest != "help":
                for option in action.option_strings:
                    yield path, parser, action, option


def test_every_spelling_of_every_boolean_flag_sets_what_its_name_says():
    wrong, seen = [], 0
    root = build_parser()
    for path, parser, action, option in _cases():
        seen += 1
        argv = [*path, *_required(parser, action), option]
        # The verb's parser alone: the top-level parser would demand a sub-command.
        args = parser.parse_args(argv[len(path):]) if path else root.parse_args([option, "report", "1"])
        got, want = getattr(args, action.dest), _expected(action, option)
        if got is not want:
            wrong.append(f"domino {' '.join(path)} {option}: {action.dest} = {got!r}, its name says {want}")
        usage = parser.format_help()
        if action.help != argparse.SUPPRESS and option not in usage:
            wrong.append(f"domino {' '.join(path)} --help does not show {option}")
    assert seen > 100, f"only {seen} boolean spellings found: the walk over the verbs is broken"
    assert not wrong, "\n".join(wrong)


def test_no_load_optim_and_no_load_rng_take_effect():
    checkpoint = parse_config(["--no-load-optim", "--no-load-rng"]).checkpoint
    assert checkpoint.no_load_optim is True and checkpoint.no_load_rng is True
    checkpoint = parse_config(["--no-load-optim", "--load-optim"]).checkpoint  # the last spelling wins
    assert checkpoint.no_load_optim is False
