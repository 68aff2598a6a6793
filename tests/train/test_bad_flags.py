"""Bad flags fail before training starts, with messages that name the problem."""

import pytest

from train_helpers import TINY, run_pretrain


@pytest.mark.parametrize("args, env, message", [
    (["--global-batch-size", "6", "--micro-batch-size", "4"], {"WORLD_SIZE": "2", "RANK": "0"},
     "--global-batch-size 6 is not divisible by --micro-batch-size 4 x data-parallel size 2"),
    (["--data-path", "/nonexistent/corpus_text_document"], {},
     "dataset prefix '/nonexistent/corpus_text_document' has no"),
    ([], {}, "no training data"),
    (["--preset", "gpt9"], {}, "unknown preset 'gpt9'"),
    (["--mock-data", "--distributed-backend", "nccl"], {}, "--distributed-backend nccl needs CUDA GPUs"),
], ids=["batch", "missing-data", "no-data", "preset", "nccl-without-cuda"])
def test_bad_flags(args, env, message):
    proc = run_pretrain([*TINY, "--train-iters", "2", *args], check=False, env=env, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "iteration" not in proc.stderr.split(message)[0]


def test_load_pointing_at_garbage(tmp_path, corpus_prefix):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "latest").write_text("not-a-tag\n")
    proc = run_pretrain([*TINY, "--train-iters", "2", "--data-path", corpus_prefix, "--load", str(garbage)],
                        check=False, timeout=180)
    assert proc.returncode == 2
    assert "latest" in proc.stderr and "iter_0000100" in proc.stderr
    assert "training 2 iterations" not in proc.stderr


def test_load_of_an_empty_directory_starts_fresh(tmp_path, corpus_prefix):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_pretrain([*TINY, "--train-iters", "1", "--eval-iters", "0", "--data-path", corpus_prefix,
                         "--load", str(empty)], timeout=180)
    assert "holds no checkpoint yet: starting from scratch" in proc.stderr
