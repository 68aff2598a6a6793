"""Restarts that a cluster makes routinely, with real processes and real files: the same command run again
after the last iteration, a SIGKILL while a checkpoint of the same iteration is being replaced, and a
``latest`` that names a checkpoint a kill left missing. Each restart must end with exit 0 and lose nothing.
"""

from __future__ import annotations

import os

from train_helpers import run_pretrain, train_losses

MOCK = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--eval-iters", "1", "--eval-interval", "0", "--hidden-dropout", "0.1"]


def _args(save, metrics, iters=4, *extra):
    return [*MOCK, "--train-iters", str(iters), "--save-interval", "2", "--save", str(save), "--load", str(save),
            "--metrics-file", str(metrics), *extra]


def _snapshot(ckpt):
    return {str(p.relative_to(ckpt)): (p.stat().st_mtime_ns, p.read_bytes()) for p in ckpt.rglob("*") if p.is_file()}


def test_a_restart_after_the_last_iteration_evaluates_and_saves_nothing(tmp_path):
    """What a pod restarted during the final evaluation runs: the finished run's own command. It resumes at
    ``--train-iters``, trains nothing, evaluates and exits 0, and does not save ``iter_0000004`` again (the
    fault hook would kill a re-save while it deletes the checkpoint it replaces)."""
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run_pretrain(_args(save, metrics))
    before = _snapshot(save / "iter_0000004")
    again = run_pretrain(_args(save, metrics), check=False, env={"DOMINO_FAULT_INJECT": "kill-in-delete@4"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to train at iteration 4 of 4" in again.stderr and "test loss at iteration 4" in again.stderr
    assert "fault injection" not in again.stderr
    assert (save / "latest").read_text().strip() == "iter_0000004"
    assert _snapshot(save / "iter_0000004") == before  # not rewritten
    assert sorted(train_losses(metrics)) == [1, 2, 3, 4]


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_kill_while_deleting_the_replaced_checkpoint_leaves_the_new_one_named(tmp_path):
    """``iter_0000004`` is damaged, so the run resumes from ``iter_0000002`` and saves iteration 4 again; a real
    SIGKILL halfway through deleting the damaged copy must leave ``latest`` naming the new, complete one."""
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run_pretrain(_args(save, tmp_path / "reference.jsonl"))
    reference = train_losses(tmp_path / "reference.jsonl")
    _flip_byte(save / "iter_0000004" / "rng" / "rank_00000.pt")
    killed = run_pretrain(_args(save, metrics), check=False, env={"DOMINO_FAULT_INJECT": "kill-in-delete@4"})
    assert killed.returncode != 0 and "fault injection: killing this process in kill-in-delete" in killed.stderr
    assert (save / ".trash-iter_0000004").is_dir()  # the kill came while deleting the replaced copy
    assert (save / "latest").read_text().strip() == "iter_0000004"

    restarted = run_pretrain(_args(save, tmp_path / "restart.jsonl"), check=False)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resumed from" in restarted.stderr and "iter_0000004 at iteration 4" in restarted.stderr
    assert "DAMAGED" not in restarted.stderr
    assert train_losses(metrics) == {3: reference[3], 4: reference[4]}  # trained again from iter_0000002, exactly

    # The next save sweeps the trash; six iterations where the checkpoint's schedule has four: taken on purpose.
    longer = run_pretrain(_args(save, tmp_path / "longer.jsonl", 6, "--override-opt_param-scheduler"), check=False)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert sorted(os.listdir(save)) == [".save.lock", ".save.lock.json", "goodput.jsonl", "iter_0000002",
                                        "iter_0000004", "iter_0000006", "latest"]


def test_latest_naming_a_missing_checkpoint_resumes_from_the_newest_complete_one(tmp_path):
    """The instant between renaming the old ``iter_0000004`` aside and the new one in: ``latest`` names a missing
    directory. A restart resumes from ``iter_0000002`` (and ``--strict-load`` refuses in one line)."""
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run_pretrain(_args(save, tmp_path / "reference.jsonl"))
    reference = train_losses(tmp_path / "reference.jsonl")
    os.replace(save / "iter_0000004", save / ".trash-iter_0000004")

    strict = run_pretrain(_args(save, metrics, 4, "--strict-load"), check=False)
    assert strict.returncode != 0 and "Traceback" not in strict.stderr
    assert "'latest' names iter_0000004, which does not exist (--strict-load refuses" in strict.stderr

    resumed = run_pretrain(_args(save, metrics), check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from the newest complete checkpoint, iter_0000002" in resumed.stderr
    losses = train_losses(metrics)
    assert sorted(losses) == [3, 4] and losses == {3: reference[3], 4: reference[4]}
    assert (save / "latest").read_text().strip() == "iter_0000004"


def test_a_save_root_without_latest_resumes_its_complete_checkpoint(tmp_path):
    """A kill after the first checkpoint was renamed in and before ``latest`` was first written."""
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run_pretrain(_args(save, tmp_path / "reference.jsonl", 2))
    (save / "latest").unlink()
    resumed = run_pretrain(_args(save, metrics, 4, "--override-opt_param-scheduler"), check=False)  # 2 -> 4 iterations
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "has no 'latest' file: resuming from the newest complete checkpoint, iter_0000002" in resumed.stderr
    assert sorted(train_losses(metrics)) == [3, 4]


def test_a_restart_resumes_its_own_checkpoint_not_load_other(tmp_path):
    """``--load OTHER --save OWN`` (continuing another run, as the cluster guide suggests): once OWN holds a
    checkpoint, a restart resumes it; it neither reloads OTHER (losing iterations 5-6) nor fails."""
    other, own = tmp_path / "other", tmp_path / "own"
    run_pretrain([*MOCK, "--train-iters", "4", "--save", str(other), "--metrics-file", str(tmp_path / "o.jsonl")])
    # Continuing OTHER past its 4 iterations: a longer decay, taken on purpose (domino.train.schedule_check).
    args = [*MOCK, "--train-iters", "8", "--save-interval", "2", "--load", str(other), "--save", str(own),
            "--override-opt_param-scheduler"]
    run_pretrain([*args, "--metrics-file", str(tmp_path / "reference.jsonl"), "--save", str(tmp_path / "ref")])
    reference = train_losses(tmp_path / "reference.jsonl")

    metrics = tmp_path / "m.jsonl"
    killed = run_pretrain([*args, "--metrics-file", str(metrics)], check=False,
                          env={"DOMINO_FAULT_INJECT": "kill-in-save@8"})
    assert killed.returncode != 0 and (own / "latest").read_text().strip() == "iter_0000006"
    restarted = run_pretrain([*args, "--metrics-file", str(metrics)], check=False)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"--save {own} already holds this run's checkpoint iter_0000006" in restarted.stderr
    losses = train_losses(metrics)
    assert sorted(losses) == [5, 6, 7, 8] and losses == {i: reference[i] for i in (5, 6, 7, 8)}


def test_a_folder_with_only_a_runs_metrics_is_a_fresh_start_and_a_model_folder_an_error(tmp_path):
    """A run killed before its first save leaves ``--metrics-file ckpt/metrics.jsonl`` (the README's layout)
    in ``--load ckpt``: the restart starts fresh instead of crash-looping; a Hugging Face folder is refused."""
    from domino.checkpoint.discovery import find_checkpoint
    from domino.config import ConfigError, parse_config

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "metrics.jsonl").write_text('{"iteration": 1}\n')
    (ckpt / "tensorboard").mkdir()
    config = parse_config(["--preset", "tiny", "--mock-data", "--save", str(ckpt), "--load", str(ckpt)])
    assert find_checkpoint(config) == (None, False)
    (ckpt / "model.safetensors").write_bytes(b"x")
    try:
        find_checkpoint(config)
    except ConfigError as error:
        assert "not a domino checkpoint directory" in str(error) and "model.safetensors" in str(error)
    else:
        raise AssertionError("a folder holding another kind of model was taken for a fresh start")
