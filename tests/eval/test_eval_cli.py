"""The evaluation verbs driven through the real ``domino`` entry point."""

import json

import pytest
import torch

from domino.eval.generate import generate, generate_ids
from eval_checkpoints import run_cli, save_checkpoint, tiny_config, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("cli")
    tokenizer = tiny_tokenizer(root / "tok")
    config = tiny_config(str(root / "tok"))
    model = tiny_model(config, tokenizer.vocab_size, seed=4)
    save_checkpoint(root / "ckpt", model, config, tokenizer=tokenizer)
    return root, model, tokenizer


def test_generate_cli_json(checkpoint, capsys):
    root, model, tokenizer = checkpoint
    code, out, _ = run_cli(["generate", "--load", str(root / "ckpt"), "--prompt-ids", "3,4,5",
                            "--max-new-tokens", "6", "--greedy", "--json", "--no-stop-at-eod"], capsys)
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["token_ids"] == generate_ids(model, [3, 4, 5], 6, vocab_size=tokenizer.vocab_size)
    assert result["text"] == tokenizer.decode(result["token_ids"])
    code, out, _ = run_cli(["generate", "--load", str(root / "ckpt"), "--prompt", "To be", "--max-new-tokens", "4",
                            "--top-k", "5", "--temperature", "0.8", "--seed", "3", "--json"], capsys)
    assert code == 0 and len(json.loads(out)["token_ids"]) <= 4


def test_generate_cli_errors(checkpoint, tmp_path, capsys):
    root, _, _ = checkpoint
    code, _, err = run_cli(["generate", "--load", str(tmp_path / "nowhere"), "--prompt", "x"], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(["generate", "--load", str(root / "ckpt"), "--prompt", "x", "--greedy",
                            "--top-k", "3"], capsys)
    assert code == 2 and "--greedy cannot be combined" in err
    code, _, err = run_cli(["generate", "--load", str(root / "ckpt"), "--prompt-ids", "1,a"], capsys)
    assert code == 2 and "--prompt-ids" in err


def test_export_import_cli(checkpoint, tmp_path, capsys):
    root, model, _ = checkpoint
    code, out, _ = run_cli(["export-hf", "--load", str(root / "ckpt"), "--output", str(tmp_path / "hf")], capsys)
    assert code == 0 and (tmp_path / "hf" / "model.safetensors").is_file()
    code, _, err = run_cli(["export-hf", "--load", str(root / "ckpt"), "--output", str(tmp_path / "hf")], capsys)
    assert code == 2 and "--overwrite" in err
    code, out, _ = run_cli(["import-hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back"),
                            "--make-vocab-size-divisible-by", "8"], capsys)
    assert code == 0 and out.strip().endswith("iter_0000000")
    code, out, _ = run_cli(["generate", "--load", str(tmp_path / "back"), "--prompt-ids", "3,4,5",
                            "--max-new-tokens", "5", "--greedy", "--json", "--no-stop-at-eod"], capsys)
    assert json.loads(out)["token_ids"] == generate_ids(model, [3, 4, 5], 5, vocab_size=checkpoint[2].vocab_size)


def test_report_cli(checkpoint, tmp_path, capsys):
    root, model, tokenizer = checkpoint
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"iteration": i, "lm_loss": 5.0 - i / 10, "tokens_per_s": 100.0 + i}) + "\n"
                               for i in range(1, 6)))
    (tmp_path / "eval.json").write_text(json.dumps({"loss": 4.5, "ppl": 90.0, "accuracy": 0.1, "tokens": 512}))
    code, out, _ = run_cli(["report", "--metrics-file", str(metrics), "--eval-json", str(tmp_path / "eval.json"),
                            "--load", str(root / "ckpt"), "--sample-prompt", "To be", "--sample-tokens", "5",
                            "--output", str(tmp_path / "report.html")], capsys)
    assert code == 0
    page = (tmp_path / "report.html").read_text()
    expected = generate(model, tokenizer, tokenizer.encode("To be"), 5).text
    import html
    assert html.escape(expected) in page and "model.hidden_size" in page and "data:image/png;base64," in page
    code, _, err = run_cli(["report", "--metrics-file", str(tmp_path / "nope.jsonl"), "--output",
                            str(tmp_path / "r.html")], capsys)
    assert code == 2 and "--metrics-file" in err
