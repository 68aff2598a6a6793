"""The forked-rank server behind ``run_pretrain`` gives what torchrun gives, and refuses what it cannot serve."""

import pytest

from train.pretrain_zygote import can_serve
from train_helpers import TINY, child_env, run_pretrain


def test_an_environment_that_changes_the_imports_is_not_served():
    server = child_env()
    assert can_serve(child_env({"DOMINO_FAULT_INJECT": "kill-in-save@4", "RANK": "0"}), server)
    assert not can_serve(child_env({"PYTHONPATH": "/elsewhere"}), server)
    assert not can_serve(child_env({"OMP_NUM_THREADS": "2"}), server)


@pytest.mark.timeout(300)
def test_a_two_rank_job_failing_on_every_rank_ends_as_under_torchrun():
    """Each rank exits 2 on a bad batch; torchrun then exits 1 (``ChildFailedError``), and so does the server."""
    args = [*TINY, "--mock-data", "--train-iters", "2", "--global-batch-size", "6", "--micro-batch-size", "4"]
    message = "--global-batch-size 6 is not divisible by --micro-batch-size 4 x data-parallel size 2"
    forked = run_pretrain(args, nproc=2, check=False, timeout=120)
    real = run_pretrain(args, nproc=2, check=False, timeout=120, torchrun=True)
    assert forked.returncode == real.returncode == 1, (forked.stderr[-2000:], real.stderr[-2000:])
    assert message in forked.stderr and message in real.stderr
    assert "ChildFailedError" in real.stderr  # torchrun's own report, which only torchrun prints
