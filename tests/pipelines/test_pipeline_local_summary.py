"""The local run's summary: the command it suggests is safe to paste into a shell."""

import subprocess

from pipelines.local_run import LocalRunResult


def test_the_suggested_generate_command_passes_the_prompt_to_domino_verbatim(tmp_path):
    marker = tmp_path / "ran"
    prompt = f"KING. $(touch {marker}) `touch {marker}` it's \"quoted\" $HOME"
    checkpoint = str(tmp_path / "my runs" / "checkpoints")
    result = LocalRunResult(
        output_dir=str(tmp_path), run_id="r", checkpoint_dir=checkpoint, model_manifest="m", report="r.html",
        metrics_file="m.jsonl", summary_file="s.json", dataset={}, train={},
        test={"test_ppl": 100.0, "samples": [{"prompt": prompt, "text": "..."}]}, promoted=True, seconds=1.0)
    (line,) = [line for line in result.verdict() if line.startswith("continue: ")]
    command = line[len("continue: "):]
    assert command.startswith("domino generate ")
    # What a user's shell does with the pasted line, with `domino` standing for a program that prints its argv.
    shell = subprocess.run(["bash", "-c", "domino() { printf '%s\\0' \"$@\"; }\n" + command], capture_output=True,
                           timeout=30)
    assert shell.returncode == 0, shell.stderr
    argv = shell.stdout.decode().split("\0")[:-1]
    assert argv[:5] == ["generate", "--load", checkpoint, "--prompt", prompt]
    assert not marker.exists()  # nothing in the prompt ran
