"""The verbs that read a checkpoint share one declaration of its flags (domino/cli/checkpoint_flags.py)."""

import ast
import os

import domino.cli
from domino.cli.main import build_parser

CHECKPOINT_FLAGS = ("--load", "--tokenizer", "--tensor-model-parallel-size", "--dtype")
#: verb -> the checkpoint flags it takes
VERBS = {"evaluate": CHECKPOINT_FLAGS, "generate": CHECKPOINT_FLAGS, "export-hf": ("--load", "--tokenizer"),
         "report": ("--load",)}


def _actions(verb):
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return {option: action for action in subparsers.choices[verb]._actions for option in action.option_strings}


def test_the_checkpoint_verbs_take_the_same_flags():
    reference = _actions("evaluate")
    for verb, flags in VERBS.items():
        actions = _actions(verb)
        for flag in flags:
            assert actions[flag].help == reference[flag].help, (verb, flag)
            assert actions[flag].type is reference[flag].type and actions[flag].metavar == reference[flag].metavar
    assert _actions("evaluate")["--load"].required and not _actions("report")["--load"].required


def test_no_other_cli_module_declares_a_checkpoint_flag():
    """``--load`` and friends appear as literals in checkpoint_flags.py only (preprocess's and import-hf's
    --tokenizer name the tokenizer of text or of a Hugging Face directory, not a checkpoint's, and
    ``checkpoint convert``'s --tensor-model-parallel-size the layout to write, not the one to load at, and
    ``goodput``'s --load the run's save root whose ledger it reads, loading no checkpoint: they stay their own)."""
    folder = os.path.dirname(domino.cli.__file__)
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py") or name == "checkpoint_flags.py":
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                literals = [a.value for a in node.args if isinstance(a, ast.Constant)]
                found += [(name, flag) for flag in literals if flag in CHECKPOINT_FLAGS]
    assert found == [("checkpoint.py", "--tensor-model-parallel-size"), ("data.py", "--tokenizer"),
                     ("goodput.py", "--load"), ("hf.py", "--tokenizer")]
