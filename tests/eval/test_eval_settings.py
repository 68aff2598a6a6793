"""The evaluation knobs are declared once (domino/eval/settings.py): ``domino evaluate``'s flags, the library
and the pipeline's evaluate step take their names and defaults from :class:`EvalSettings`."""

import dataclasses
import inspect

import pytest

from components import kfp_functions
from components.evaluate.step import EvaluateSettings
from domino.cli.main import build_parser
from domino.config import ConfigError
from domino.config.field_docs import field_docs
from domino.eval.evaluate import evaluate_checkpoint
from domino.eval.settings import EvalSettings, eval_settings_from_args

FIELDS = [f.name for f in dataclasses.fields(EvalSettings)]


def _parse(*flags):
    return build_parser().parse_args(["evaluate", "--load", "ckpt", *flags])


def test_the_cli_library_and_component_share_the_defaults():
    defaults = EvalSettings()
    assert (defaults.eval_tokens, defaults.eval_iters, defaults.max_samples, defaults.micro_batch_size) == (
        65536, None, None, 16)
    assert eval_settings_from_args(_parse()) == defaults
    # The library takes the knobs as one EvalSettings (None: its defaults), under no other name.
    parameters = inspect.signature(evaluate_checkpoint).parameters
    assert parameters["settings"].default is None
    assert not set(parameters) & {*FIELDS, "max_batches", "max_tokens"}
    # The component: its parameters left alone are EvalSettings' defaults, and so is the kfp signature.
    step = EvaluateSettings(shared_root="/r", run_id="r")
    assert step.eval_settings() == defaults
    kfp = inspect.signature(kfp_functions.evaluate).parameters
    assert EvaluateSettings(shared_root="/r", run_id="r", eval_batches=kfp["eval_batches"].default,
                            eval_micro_batch_size=kfp["eval_micro_batch_size"].default).eval_settings() == defaults
    assert step.__class__(shared_root="/r", run_id="r", eval_batches=3).eval_settings() == EvalSettings(eval_iters=3)


def test_the_flags_are_the_fields_and_keep_their_spellings():
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    actions = {a.dest: a for a in subparsers.choices["evaluate"]._actions}
    docs = field_docs(EvalSettings)
    for name in FIELDS:
        assert actions[name].option_strings == ["--" + name.replace("_", "-")]
        assert actions[name].default == getattr(EvalSettings(), name)
        assert actions[name].help.replace("%%", "%").startswith(" ".join(docs[name].split()))
    assert eval_settings_from_args(_parse("--eval-iters", "3")) == EvalSettings(eval_iters=3)
    assert eval_settings_from_args(_parse("--eval-tokens", "all")).eval_tokens is None
    assert eval_settings_from_args(_parse("--max-samples", "5", "--micro-batch-size", "4")) == EvalSettings(
        max_samples=5, micro_batch_size=4)
    with pytest.raises(SystemExit):
        _parse("--eval-iters", "3", "--eval-tokens", "32")  # one amount at a time


def test_a_count_replaces_the_token_budget_and_bad_values_name_their_flag():
    assert EvalSettings().token_budget == 65536
    assert EvalSettings(eval_iters=2).token_budget is None and EvalSettings(max_samples=2).token_budget is None
    for settings, flag in ((EvalSettings(micro_batch_size=0), "--micro-batch-size"),
                           (EvalSettings(eval_iters=0), "--eval-iters"), (EvalSettings(max_samples=-1), "--max-samples"),
                           (EvalSettings(eval_iters=1, max_samples=1), "--eval-iters and --max-samples")):
        with pytest.raises(ConfigError, match=flag):
            settings.check()
