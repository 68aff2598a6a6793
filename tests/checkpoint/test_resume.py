"""Kill a run (mid-training and mid-checkpoint-write), restart the same command: identical losses."""

import signal
import subprocess
import time

from train.train_helpers import TINY, child_env, pretrain_command, run_pretrain, train_losses


def _args(prefix, save, metrics):
    return [*TINY, "--data-path", prefix, "--train-iters", "12", "--save-interval", "4", "--save", str(save),
            "--load", str(save), "--metrics-file", str(metrics), "--eval-iters", "0", "--eval-interval", "0",
            "--hidden-dropout", "0.1"]  # dropout on: resuming must restore the RNG streams too


def _kill_when_logged(args, metrics, iteration, timeout=240):
    proc = subprocess.Popen(pretrain_command(args), env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and iteration in train_losses(metrics):
                proc.kill()  # SIGKILL: no chance to clean up or save
                break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert iteration in train_losses(metrics), "the run never reached the kill point"


def test_killed_runs_resume_bit_for_bit(tmp_path, corpus_prefix):
    reference = tmp_path / "reference.jsonl"
    run_pretrain(_args(corpus_prefix, tmp_path / "ref-ckpt", reference))
    expected = train_losses(reference)
    assert sorted(expected) == list(range(1, 13))

    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    _kill_when_logged(_args(corpus_prefix, save, metrics), metrics, iteration=6)
    assert (save / "latest").read_text().strip() == "iter_0000004"

    killed = run_pretrain(_args(corpus_prefix, save, metrics), check=False,
                          env={"DOMINO_FAULT_INJECT": "kill-in-save@8"})
    assert killed.returncode != 0
    assert (save / "latest").read_text().strip() == "iter_0000004"  # the cut-short save changed nothing visible
    assert len(list(save.glob(".tmp-iter_0000008.*"))) == 1  # the killed run's own temporary directory

    run_pretrain(_args(corpus_prefix, save, metrics))
    assert (save / "latest").read_text().strip() == "iter_0000012"
    resumed = train_losses(metrics)
    assert sorted(resumed) == list(range(1, 13))
    assert resumed == expected  # exact float equality: bit for bit on CPU


def test_warm_start_across_tp_sizes_then_restart_resumes_own_checkpoint(tmp_path, corpus_prefix):
    """A TP=1 model warm-starts a TP=2 run (vocabulary re-padded 50304 -> 50432 rows); restarting that
    run's command resumes its own checkpoint in --save instead of warm-starting again."""
    base = [*TINY, "--data-path", corpus_prefix, "--eval-iters", "0", "--eval-interval", "0"]
    run_pretrain([*base, "--train-iters", "2", "--save", str(tmp_path / "promoted")])
    warm = [*base, "--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--load", str(tmp_path / "promoted"),
            "--finetune", "--save", str(tmp_path / "run")]
    first = run_pretrain([*warm, "--train-iters", "2"], nproc=2)
    assert "re-padding the vocabulary from 50304 to 50432 rows" in first.stderr
    assert "warm start from" in first.stderr
    # One iteration more than the first run's schedule: a longer decay, taken on purpose.
    again = run_pretrain([*warm, "--train-iters", "3", "--override-opt_param-scheduler"], nproc=2)
    assert "resuming it instead of warm-starting" in again.stderr
    assert "iteration      3/3" in again.stderr and "iteration      1/3" not in again.stderr


def test_keep_last_prunes_older_checkpoints(tmp_path, corpus_prefix):
    save = tmp_path / "ckpt"
    run_pretrain([*TINY, "--data-path", corpus_prefix, "--train-iters", "4", "--eval-iters", "0", "--eval-interval",
                  "0", "--save", str(save), "--save-interval", "1", "--keep-last", "2"])
    assert sorted(p.name for p in save.iterdir()) == [".save.lock", ".save.lock.json", "goodput.jsonl", "iter_0000003",
                                                      "iter_0000004", "latest"]


def test_sigterm_saves_and_the_restart_continues_exactly(tmp_path, corpus_prefix):
    """--exit-signal-handler: SIGTERM (a preempted pod) saves after the current iteration, exits 143, and the
    same command resumes to the uninterrupted run's losses. The signalled run saves with --async-save (the
    reference synchronously): SIGTERM waits for the save in flight and commits its own before exiting."""
    reference = tmp_path / "reference.jsonl"
    run_pretrain([*_args(corpus_prefix, tmp_path / "ref-ckpt", reference), "--exit-signal-handler"])
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    args = [*_args(corpus_prefix, save, metrics), "--exit-signal-handler", "--async-save"]
    proc = subprocess.Popen(pretrain_command(args), env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and 5 in train_losses(metrics):
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.05)
        assert proc.wait(timeout=120) == 143
    finally:
        proc.kill()
    stopped_at = int((save / "latest").read_text().strip().split("_")[1])
    assert 5 <= stopped_at < 12  # the run stopped early, after saving where it stood
    assert not list(save.glob(".tmp-*"))  # and committed every save it had started
    run_pretrain(args)
    assert train_losses(metrics) == train_losses(reference)
