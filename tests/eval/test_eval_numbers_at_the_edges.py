"""Numbers at the edges of the readers of a checkpoint: prompt ids outside the vocabulary, a report of losses near
the largest float. Each is one line from the real command, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from eval_checkpoints import run_cli, tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    return root, tiny_checkpoint(root).vocab_size


@pytest.fixture
def domino(capsys):
    """``domino ARGV`` in this process (as tests/eval/eval_checkpoints.py's ``run_cli``: the same verbs, no
    interpreter start per call), as a completed process: ``returncode``, ``stdout``, ``stderr``."""
    def run(*argv) -> subprocess.CompletedProcess:
        code, out, err = run_cli(list(argv), capsys)
        return subprocess.CompletedProcess(["domino", *argv], code or 0, out, err)
    return run


def _one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (error,) = {line for line in proc.stderr.splitlines() if "error: " in line}
    return error.split("error: ", 1)[1]


def test_prompt_ids_outside_the_vocabulary_are_one_line(saved, domino):
    root, vocab = saved
    for ids, message in ((f"3,{vocab}", f"--prompt-ids: id {vocab} is outside the vocabulary [0, {vocab})"),
                         ("99999999", f"--prompt-ids: id 99999999 is outside the vocabulary [0, {vocab})"),
                         ("-5", "--prompt-ids must be comma-separated integers >= 0, got '-5'")):
        assert _one_error(domino("generate", "--load", str(root / "ckpt"), f"--prompt-ids={ids}",
                                  "--max-new-tokens", "1")) == message
    done = domino("generate", "--load", str(root / "ckpt"), f"--prompt-ids=3,{vocab - 1}", "--max-new-tokens", "1")
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_report_of_losses_near_the_largest_float_is_written(tmp_path, domino):
    records = [{"iteration": 1, "lm_loss": 1e308, "tokens_per_s": 1e308, "grad_norm": 1e99, "lr": 1e-300},
               {"iteration": 2, "lm_loss": 3.5, "tokens_per_s": 5.0, "grad_norm": -1e99, "lr": 1e-4},
               {"iteration": 3, "lm_loss": -1e308}, {"iteration": 1e308, "lm_loss": 2.0},
               {"iteration": 4, "lm_loss": 1e99}, {"iteration": 5, "lm_loss": -1e99}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    done = domino("report", "--metrics-file", str(metrics), "--output", str(tmp_path / "report.html"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "report: 3 lm_loss value(s) beyond +-1e+100 are not drawn" in done.stderr  # the 1e99 ones are drawn
    assert "report: 1 tokens_per_s value(s) beyond" in done.stderr
    assert (tmp_path / "report.html").read_text().count("data:image/png;base64,") == 3


def _edited_copy(saved, tmp_path, edit) -> Path:
    root, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", copy)
    meta_path = copy / "iter_0000001" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    return copy


def test_inspect_finds_a_layer_count_the_shards_do_not_hold(saved, tmp_path, domino):
    root, _ = saved
    intact = domino("checkpoint", "inspect", "--load", str(root / "ckpt"), "--no-progress")
    assert intact.returncode == 0 and "integrity: unverified" in intact.stdout, intact.stdout + intact.stderr[-2000:]
    lying = _edited_copy(saved, tmp_path, lambda meta: meta["config"]["model"].update(num_layers=3))
    found = domino("checkpoint", "inspect", "--load", str(lying), "--no-progress")
    assert found.returncode == 1, found.stdout + found.stderr[-2000:]
    assert "integrity: DAMAGED: " in found.stdout and "num_layers is 3 but the shards hold 2 layers" in found.stdout


def test_an_iteration_that_disagrees_with_its_folder_is_refused(saved, tmp_path, domino):
    lying = _edited_copy(saved, tmp_path, lambda meta: meta.update(iteration=5))
    for argv in (["checkpoint", "inspect", "--load", str(lying)],
                 ["generate", "--load", str(lying), "--prompt-ids=3", "--max-new-tokens", "1"]):
        error = _one_error(domino(*argv))
        assert error.endswith("checkpoint.json: iteration 5 disagrees with its folder's name iter_0000001"), error


def test_overwrite_replaces_only_an_earlier_output_of_the_same_command(saved, tmp_path, domino):
    root, _ = saved
    export, imported = tmp_path / "hf", tmp_path / "imported"
    for argv, output in ((["export-hf", "--load", str(root / "ckpt")], export),
                         (["import-hf", "--input", str(export)], imported)):
        assert domino(*argv, "--output", str(output)).returncode == 0
        written = sorted(os.listdir(output))
        (output / "notes.txt").write_text("mine")
        error = _one_error(domino(*argv, "--output", str(output), "--overwrite"))
        assert error.startswith(f"--output {output} holds 1 file(s) this command did not write (notes.txt)"), error
        assert (output / "notes.txt").read_text() == "mine" and sorted(os.listdir(output)) == sorted(written + ["notes.txt"])
        (output / "notes.txt").unlink()
        done = domino(*argv, "--output", str(output), "--overwrite")
        assert done.returncode == 0 and sorted(os.listdir(output)) == written, done.stderr[-3000:]


def test_an_output_name_too_long_for_its_temporaries_is_refused_before_any_work(saved, tmp_path, domino):
    root, _ = saved
    (tmp_path / "in.jsonl").write_text('{"text": "a document"}\n')
    # each fits alone; not the temporary .NAME_text_document.meta.json.tmp-PID-XXXXXXXX, nor the staging .NAME.XXXXXXXX
    for argv in (["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(root / "tok"),
                  "--output-prefix", str(tmp_path / ("x" * 230))],
                 ["export-hf", "--load", str(root / "ckpt"), "--output", str(tmp_path / ("x" * 250))]):
        error = _one_error(domino(*argv))
        assert "that is over the 255 bytes a name may have here" in error, error
    assert os.listdir(tmp_path) == ["in.jsonl"]
