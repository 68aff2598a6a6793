"""``domino pretrain --save X`` without ``--load``, into a root that holds checkpoints, resumes them (``--load``
defaults to ``--save``, as ``domino launch`` and the pipeline pass it), with one line; before, it trained from 0
over them without a word."""

from train.train_helpers import TINY, read_metrics, run_pretrain

# A fixed decay length: a run of 3 iterations continued to 5 keeps its learning-rate schedule (a changed one is
# refused, domino/train/schedule_check.py).
ARGS = [*TINY, "--mock-data", "--vocab-size", "256", "--eval-iters", "0", "--eval-interval", "0",
        "--lr-decay-iters", "5"]


def test_a_used_save_root_without_load_is_resumed(tmp_path):
    save = tmp_path / "ckpt"
    run_pretrain([*ARGS, "--train-iters", "3", "--save", str(save), "--metrics-file", str(tmp_path / "a.jsonl")])
    second = run_pretrain([*ARGS, "--train-iters", "5", "--save", str(save),
                           "--metrics-file", str(tmp_path / "b.jsonl")])
    output = second.stdout + second.stderr
    assert "already holds checkpoints and no --load was given: resuming iter_0000003" in output, output[-3000:]
    iterations = [r["iteration"] for r in read_metrics(tmp_path / "b.jsonl") if "lm_loss" in r and "eval" not in r]
    assert iterations == [4, 5], output[-3000:]
    assert (save / "iter_0000005").is_dir()


def test_an_empty_save_root_without_load_starts_fresh(tmp_path):
    proc = run_pretrain([*ARGS, "--train-iters", "2", "--save", str(tmp_path / "new"),
                         "--metrics-file", str(tmp_path / "m.jsonl")])
    assert "no --load was given" not in proc.stdout + proc.stderr
    assert [r["iteration"] for r in read_metrics(tmp_path / "m.jsonl") if "lm_loss" in r] == [1, 2]
