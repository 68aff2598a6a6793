"""Numbers at the edges of the flags: a ``--data-path`` weight that is negative, ``nan`` or ``inf``, a ``--split``
part that is not finite, any float setting at ``inf`` or ``nan`` is one line naming the flag before any work; a
dataset of weight 0 is left out with one line saying so."""

from __future__ import annotations

import pytest

from domino.config import ConfigError, parse_config
from domino.config.data_specs import parse_data_prefix
from train.train_helpers import TINY, run_pretrain

BASE = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--train-iters", "2"]


@pytest.mark.parametrize("flags, message", [
    (["--data-path", "-1", "a", "2", "b"], "--data-path: weight -1 of a must be a finite number >= 0"),
    (["--data-path", "nan", "a", "2", "b"], "--data-path: weight nan of a must be a finite number >= 0"),
    (["--train-data-path", "1", "a", "inf", "b"], "--train-data-path: weight inf of b must be a finite number >= 0"),
    (["--data-path", "0", "a", "0", "b"], "--data-path 0 a 0 b: the weights must have a positive sum"),
    (["--split", "nan,1,1"], "--split 'nan,1,1': the parts must be finite numbers >= 0 with a positive sum"),
    (["--split", "1,inf,1"], "--split '1,inf,1': the parts must be finite numbers >= 0 with a positive sum"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--min-lr", "nan"], "--min-lr must be a finite number, got nan"),
    (["--adam-eps", "nan"], "--adam-eps must be a finite number, got nan"),
    (["--clip-grad=-inf"], "--clip-grad must be a finite number, got -inf"),
    (["--hang-timeout-s", "600"], "--hang-timeout-s 600 must be shorter than --distributed-timeout-minutes 10 (600 s), "
                                  "whose collective timeout would end the run first without naming the hung rank"),
])
def test_numbers_that_are_not_finite_or_negative_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ConfigError) as error:
        parse_config([*BASE, *flags], world_size=1)
    assert str(error.value).split("; ") == [message]  # one problem, not the same one twice


def test_a_hang_timeout_inside_the_collective_timeout_is_accepted_and_the_derived_one_kept_inside_it():
    parse_config([*BASE, "--hang-timeout-s", "599"], world_size=1)
    parse_config([*BASE, "--hang-timeout-s", "0", "--distributed-timeout-minutes", "1"], world_size=1)  # off
    from domino.runtime.hang_watch import HangWatch

    watch = HangWatch(None, long_phase_timeout_s=60.0)  # no process group: a no-op that still derives its timeout
    watch.recent_steps = [1.0]
    assert watch.timeout_s == 30.0  # 180 s floor, capped at half of the 60 s collective timeout
    assert HangWatch(None, long_phase_timeout_s=3600.0).timeout_s == 180.0


def test_a_dataset_of_weight_zero_is_left_out_with_one_line(tmp_path, corpus_prefix):
    assert parse_data_prefix(["0", "a", "2", "b"]) == (["b"], [2.0])
    # "missing" has no files: left out, it is never opened (a weight -1 made the run train on the other alone)
    proc = run_pretrain([*TINY, "--data-path", "0", str(tmp_path / "missing"), "2", corpus_prefix,
                         "--train-iters", "1", "--eval-iters", "0", "--eval-interval", "0"])
    notes = [line for line in proc.stderr.splitlines() if "weight 0" in line]
    assert len(notes) == 1 and notes[0].endswith(f"--data-path: {tmp_path / 'missing'} has weight 0 and is left out")
    proc = run_pretrain([*TINY, "--data-path", "-1", str(tmp_path / "missing"), "2", corpus_prefix,
                         "--train-iters", "1"], check=False)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert errors == [f"domino pretrain: error: --data-path: weight -1 of {tmp_path / 'missing'} must be a finite "
                      "number >= 0"]
