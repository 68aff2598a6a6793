"""The pretrain step's ``resume_from_run``: a preempted pipeline run continued under a new run id, its checkpoints
found from the old run's folder; the new run saves into its own (real ``domino pretrain`` runs)."""

import pytest

from components.layout import RunLayout
from components.pretrain.step import load_argv
from domino.checkpoint import on_disk
from train.train_helpers import TINY, read_metrics, run_pretrain

# A fixed decay length: a run of 3 iterations continued to 5 keeps its learning-rate schedule (a changed one is
# refused, domino/train/schedule_check.py).
ARGS = [*TINY, "--mock-data", "--vocab-size", "256", "--eval-iters", "0", "--eval-interval", "0",
        "--lr-decay-iters", "5"]


def test_a_new_run_continues_the_old_runs_checkpoint_and_saves_into_its_own_folder(tmp_path):
    old, new = RunLayout(str(tmp_path), "run-old"), RunLayout(str(tmp_path), "run-new")
    run_pretrain([*ARGS, "--train-iters", "3", "--save", old.checkpoint_dir, "--metrics-file", old.metrics_file])
    load = load_argv(False, new, "run-old")
    assert load == ["--load", old.checkpoint_dir]
    run_pretrain([*ARGS, "--train-iters", "5", "--save", new.checkpoint_dir, *load, "--metrics-file", new.metrics_file])
    assert [r["iteration"] for r in read_metrics(new.metrics_file) if "lm_loss" in r] == [4, 5]  # continued
    assert on_disk.find_latest_checkpoint(new.checkpoint_dir).name == "iter_0000005"
    assert on_disk.find_latest_checkpoint(old.checkpoint_dir).name == "iter_0000003"  # the old run untouched
    # A retried step of the new run resumes its own checkpoint from then on.
    assert load_argv(False, new, "run-old") == ["--load", new.checkpoint_dir]


def test_a_run_to_resume_without_checkpoints_or_with_warm_start_is_refused_in_one_line(tmp_path):
    new = RunLayout(str(tmp_path), "run-new")
    with pytest.raises(ValueError, match=r"resume_from_run 'gone': .*runs/gone/checkpoints holds no checkpoint"):
        load_argv(False, new, "gone")
    with pytest.raises(ValueError, match="resume_from_run and warm_start: choose one"):
        load_argv(True, new, "run-old")
    with pytest.raises(ValueError, match="run_id"):
        load_argv(False, new, "../elsewhere")
