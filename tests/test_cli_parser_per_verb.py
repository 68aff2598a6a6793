"""``domino NAME ...`` builds only NAME's parser when NAME is a self-named verb (a rank's start parses its command
line after every preemption): the same namespace as the whole parser's, and the other verbs' modules unimported."""

import argparse
import subprocess
import sys

import pytest

from domino.cli.main import SELF_NAMED_VERBS, VERB_MODULES, build_parser, verbs_for


def _commands(parser: argparse.ArgumentParser):
    return set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def test_the_self_named_verbs_register_their_own_name_alone():
    everything = _commands(build_parser())
    for name in VERB_MODULES:
        if name in SELF_NAMED_VERBS:
            assert _commands(build_parser([name])) == {name}, name
        else:  # `domino data` is no command: the whole parser's error, listing every command, must answer it
            assert name not in everything, name


@pytest.mark.parametrize("argv", [
    ["pretrain", "--preset", "demo", "--tensor-model-parallel-size", "2", "--mock-data", "--save", "s"],
    ["--local_rank=1", "pretrain", "--preset", "tiny"],
    ["--log-level", "DEBUG", "--local-rank", "0", "pretrain", "--preset", "tiny", "--exit-signal-handler"],
    ["goodput", "--load", "root", "--json"],
])
def test_one_verbs_parser_parses_as_the_whole_parser(argv):
    assert len(verbs_for(argv)) == 1
    assert vars(build_parser(verbs_for(argv)).parse_args(argv)) == vars(build_parser().parse_args(argv))


@pytest.mark.parametrize("argv", [[], ["--help"], ["--version"], ["--log-level", "INFO"], ["data"], ["nosuch"],
                                  ["--log-level", "--help", "pretrain"], ["--log-level"],
                                  ["--local_rank", "-1", "pretrain"], ["preprocess", "--input", "x"]])
def test_anything_else_gets_every_verb(argv):
    assert verbs_for(argv) == tuple(VERB_MODULES)


def test_a_pretrain_command_line_imports_no_other_verb():
    code = ("import sys\nfrom domino.cli.main import main\ntry:\n    main(['pretrain', '--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "others = [m for m in sys.modules if m.startswith(('domino.cli.', 'domino.launch.api', 'domino.eval'))"
            " and m != 'domino.cli.pretrain' and m != 'domino.cli.main']\nassert not others, others")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "--tensor-model-parallel-size" in out
