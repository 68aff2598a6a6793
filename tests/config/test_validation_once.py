"""Validation happens once, in ``domino.config.validate``, which every entry point calls: ``domino pretrain``,
``domino launch render``/``submit`` and the KFP pretrain step (both through ``resolve_pretrain``).
A bad value is refused by each of them with one line naming the flag, before any work starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from domino.config import ConfigError, parse_config
from domino.config.bounds import MINIMUMS, POSITIVE
from domino.config.field_docs import flag_name

BASE = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--eval-iters", "0", "--eval-interval", "0"]
MESSAGE = "--train-iters must be >= 1, got -3"


def _domino(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "domino", *argv], capture_output=True, text=True, timeout=120)


def test_a_negative_train_iters_is_refused_in_one_line_by_the_cli_and_the_launcher():
    trained = _domino("pretrain", *BASE, "--train-iters", "-3")
    assert trained.returncode == 2 and "Traceback" not in trained.stderr
    assert [line for line in trained.stderr.splitlines() if "--train-iters" in line] == [
        f"domino pretrain: error: {MESSAGE}"]
    rendered = _domino("launch", "render", "--name", "gpt", "--image", "i", "--", *BASE, "--train-iters", "-3")
    assert rendered.returncode != 0 and rendered.stdout == ""  # no manifest
    assert [line for line in rendered.stderr.splitlines() if "--train-iters" in line] == [
        f"domino launch render: error: domino pretrain arguments (world size 1): {MESSAGE}"]


def test_the_kfp_step_refuses_it_with_the_same_message():
    from components.pretrain.step import PretrainSettings, job_spec
    from domino.launch.pretrain_args import resolve_pretrain
    from domino.launch.spec import LaunchSpecError

    spec = job_spec(PretrainSettings(shared_root="/mnt/domino", run_id="r", nodes=1, nproc_per_node=1),
                    [*BASE, "--train-iters", "-3"])
    with pytest.raises(LaunchSpecError, match=MESSAGE):
        resolve_pretrain(spec)


@pytest.mark.parametrize("name,minimum", [(n, m) for limits in MINIMUMS.values() for n, m in limits.items()])
def test_each_lower_bound_is_enforced_and_names_its_flag(name, minimum):
    length = [] if name in ("train_iters", "train_samples") else (
        ["--train-samples", "64"] if name.endswith("_samples") else ["--train-iters", "4"])
    with pytest.raises(ConfigError, match=f"{flag_name(name)} must be >= {minimum}, got {minimum - 1}"):
        parse_config([*BASE, *length, flag_name(name), str(minimum - 1)])
    try:
        parse_config([*BASE, *length, flag_name(name), str(minimum)])
    except ConfigError as error:  # another rule may refuse the combination, never this bound
        assert f"{flag_name(name)} must be >=" not in str(error)


@pytest.mark.parametrize("name", [n for names in POSITIVE.values() for n in names])
def test_each_positive_setting_is_enforced(name):
    with pytest.raises(ConfigError, match=f"{flag_name(name)} must be > 0, got 0"):
        parse_config([*BASE, "--train-iters", "4", flag_name(name), "0"])
