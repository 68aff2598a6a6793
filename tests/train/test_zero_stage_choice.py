"""The default ZeRO stage: 0 at one data-parallel replica, 1 otherwise, the resumed checkpoint's when resuming.

With one replica ZeRO 1 has nothing to shard (``domino.config.validate.zero_stage_for``), so the default is the
plain optimizer; these runs check that the choice does not change the maths, that a resumed run keeps its
checkpoint's stage unless told otherwise, and that another stage reads the same state (it is stored by parameter
name: ``domino/optim/state.py``).

The learning rate is constant (no warm-up, no decay) so a run that stops at iteration 4 and one that goes on to
6 follow the same schedule: a resumed run's losses can then be compared with an uninterrupted one's.
"""

from __future__ import annotations

from train_helpers import read_metrics, run_pretrain, train_losses

BASE = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--eval-iters", "0", "--eval-interval", "0", "--lr-decay-style", "constant",
        "--lr-warmup-iters", "0"]


def _run(tmp_path, name, iters, *flags, nproc=1, check=True):
    metrics = tmp_path / f"{name}.jsonl"
    proc = run_pretrain([*BASE, "--train-iters", str(iters), "--metrics-file", str(metrics), *flags], nproc=nproc,
                        check=check, timeout=600)
    return proc, (train_losses(metrics) if metrics.exists() else {})


def test_default_at_one_replica_is_zero_0_with_the_losses_of_zero_1_and_checkpoints_resume_on_either(tmp_path):
    proc, auto = _run(tmp_path, "auto", 6)
    assert "--zero-stage not given: 0 (one data-parallel replica" in proc.stderr
    assert "ZeRO 0" in proc.stderr
    _, zero1 = _run(tmp_path, "zero1", 6, "--zero-stage", "1")
    assert sorted(auto) == sorted(zero1) == list(range(1, 7))
    # Same maths, different summation: ZeRO 1 clips and steps a flat fp32 copy (DeepSpeed's own norm and
    # AdamW over one buffer), stage 0 clips per parameter (deepspeed.runtime.utils.clip_grad_norm_) and steps
    # torch's fused AdamW per tensor. Measured (torch 2.13 CPU, fp32): 5 of 6 losses bit-equal, one 1 ulp apart
    # (8.5e-8 relative); the bound, 1e-6 relative (~10 ulps), is as tight as allows for other CPUs' kernels.
    for i in auto:
        assert abs(auto[i] - zero1[i]) <= 1e-6 * abs(zero1[i]), (i, auto[i], zero1[i])

    # A checkpoint of a ZeRO 1 run at one replica (the default before) resumes with its own stage...
    save = tmp_path / "zero1-ckpt"
    _run(tmp_path, "zero1-first", 4, "--zero-stage", "1", "--save", str(save))
    proc, resumed = _run(tmp_path, "resumed", 6, "--load", str(save), "--save", str(save))
    assert "--zero-stage not given: 1 (the stage of the checkpoint whose optimizer state is resumed)" in proc.stderr
    assert resumed == {i: zero1[i] for i in (5, 6)}  # exact: the same optimizer, the same state
    # ... and an explicit stage of the other kind (the plain AdamW) continues from the same state.
    _, plain = _run(tmp_path, "plain", 6, "--load", str(save / "iter_0000004"), "--zero-stage", "0")
    assert sorted(plain) == [5, 6]
    for i in plain:
        assert abs(plain[i] - zero1[i]) <= 1e-6 * abs(zero1[i]), (i, plain[i], zero1[i])
