"""domino preprocess: outputs Megatron reads, input formats, error messages with file and line, atomicity."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from domino.data import preprocess as preprocess_module
from domino.data.builtin_corpora import list_builtin_corpora
from domino.data.errors import DataError
from domino.data.indexed_dataset import IndexedDataset
from domino.data.preprocess import preprocess
from domino.data.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("gpt2")


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_jsonl_two_keys_with_eod(tmp_path, gpt2):
    src = _jsonl(tmp_path / "a.jsonl", [{"text": "Hello world", "title": "One"},
                                        {"text": ["Hello", " world"], "title": "Two"}])
    result = preprocess([src], str(tmp_path / "out"), json_keys=["text", "title"])
    assert set(result.prefixes) == {"text", "title"}
    assert result.prefixes["text"] == str(tmp_path / "out_text_document")
    text = IndexedDataset(result.prefixes["text"])
    assert text.dtype == np.uint16
    # a list value is Megatron's sentence list: one sequence per sentence, eod closing the last one
    assert text.num_documents == 2 and len(text) == 3
    assert text[0].tolist() == [15496, 995, 50256] and text[1].tolist() == [15496] and text[2].tolist() == [995, 50256]
    assert text.get_document(1).tolist() == [15496, 995, 50256]
    title = IndexedDataset(result.prefixes["title"])
    assert title[0].tolist() == gpt2.encode("One") + [50256]
    assert result.documents == 2 and result.tokens == 6 + len(title[0]) + len(title[1])


def test_empty_documents_are_empty_index_entries(tmp_path):
    src = _jsonl(tmp_path / "e.jsonl", [{"text": "a"}, {"text": ""}, {"text": ["", "b"]}, {"text": []}])
    result = preprocess([src], str(tmp_path / "e"))
    ds = IndexedDataset(result.prefixes["text"])
    assert ds.num_documents == 4 and len(ds) == 2 and ds.document_index.tolist() == [0, 1, 1, 2, 2]
    assert ds.get_document(1).tolist() == [] and ds.get_document(2).tolist() == [65, 50256]
    assert result.documents == 4 and result.empty_documents == 2 and "2 of the documents are empty" in result.summary()
    only_empty = _jsonl(tmp_path / "z.jsonl", [{"text": ""}])
    with pytest.raises(DataError, match="no tokens"):
        preprocess([only_empty], str(tmp_path / "z"))
    assert len(result.idx_sha256["text"]) == 64 and result.vocab_size == 50257


def test_txt_blocks_and_document_per_file(tmp_path, gpt2):
    src = tmp_path / "b.txt"
    src.write_text("first line\nsecond line\n\n  \n\nthird block\n")
    result = preprocess([str(src)], str(tmp_path / "blocks"), append_eod=False)
    ds = IndexedDataset(result.prefixes["text"])
    assert [gpt2.decode(ds[i]) for i in range(len(ds))] == ["first line\nsecond line", "third block"]
    whole = preprocess([str(src)], str(tmp_path / "whole"), txt_document_per_file=True)
    ds = IndexedDataset(whole.prefixes["text"])
    assert len(ds) == 1 and gpt2.decode(ds[0]) == src.read_text() + "<|endoftext|>"


def test_glob_and_several_files_in_order(tmp_path, gpt2):
    for name, word in (("x1.jsonl", "alpha"), ("x2.jsonl", "beta")):
        _jsonl(tmp_path / name, [{"text": word}])
    result = preprocess([str(tmp_path / "x*.jsonl")], str(tmp_path / "g"), workers=2)
    ds = IndexedDataset(result.prefixes["text"])
    assert [gpt2.decode(ds[i][:-1]) for i in range(2)] == ["alpha", "beta"]


def test_workers_give_identical_output(tmp_path):
    one = preprocess(None, str(tmp_path / "w1"), builtin_corpus="shakespeare-small", workers=1)
    two = preprocess(None, str(tmp_path / "w2"), builtin_corpus="shakespeare-small", workers=2)
    assert one.idx_sha256 == two.idx_sha256
    assert (tmp_path / "w1_text_document.bin").read_bytes() == (tmp_path / "w2_text_document.bin").read_bytes()
    assert one.documents == 70 and one.tokens > 80_000


@pytest.mark.parametrize("content,message", [
    (b'{"text": "ok"}\n{"text": "broken"\n', "bad.jsonl:2: malformed JSON"),
    (b'{"text": "ok"}\n\n{"body": "x"}\n', "bad.jsonl:3: missing key 'text' \\(keys present: body\\)"),
    (b'{"text": 5}\n', "bad.jsonl:1: key 'text' holds int"),
    (b'[1, 2]\n', "bad.jsonl:1: expected a JSON object"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "bad.jsonl:2: bytes are not valid UTF-8 \\(byte 0xe9"),
    (b"", "bad.jsonl holds no documents"),
])
def test_bad_input_names_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message):
        preprocess([str(tmp_path / "bad.jsonl")], str(tmp_path / "out"))
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out") or f.startswith(".out")]


def test_skip_bad_lines_counts(tmp_path):
    (tmp_path / "mixed.jsonl").write_bytes(b'{"text": "a"}\nnot json\n{"text": "b"}\n{"t": 1}\n{"text": "\xff"}\n')
    result = preprocess([str(tmp_path / "mixed.jsonl")], str(tmp_path / "out"), skip_bad_lines=True)
    assert result.documents == 2 and result.skipped_lines == 3
    assert "3 bad lines skipped" in result.summary()


def test_bad_txt_bytes_name_the_line(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"fine\n\nstill fine\nbad \xc3\x28 here\n")
    with pytest.raises(DataError, match="t.txt:4: bytes are not valid UTF-8"):
        preprocess([str(tmp_path / "t.txt")], str(tmp_path / "out"))


def test_argument_errors_before_work(tmp_path):
    with pytest.raises(DataError, match="matches no file"):
        preprocess([str(tmp_path / "none*.jsonl")], str(tmp_path / "o"))
    with pytest.raises(DataError, match="unsupported file type"):
        (tmp_path / "x.csv").write_text("a,b\n")
        preprocess([str(tmp_path / "x.csv")], str(tmp_path / "o"))
    with pytest.raises(DataError, match="exactly one"):
        preprocess(None, str(tmp_path / "o"))
    with pytest.raises(DataError, match="unknown built-in corpus 'nope'"):
        preprocess(None, str(tmp_path / "o"), builtin_corpus="nope")
    with pytest.raises(DataError, match="--workers"):
        preprocess(None, str(tmp_path / "o"), builtin_corpus="kjv", workers=0)
    assert not (tmp_path / "o_text_document.idx").exists()


def test_failure_keeps_previous_dataset_and_leaves_no_temporaries(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "in.jsonl", [{"text": f"document {i}"} for i in range(50)])
    first = preprocess([src], str(tmp_path / "out"))
    before = {f: (tmp_path / f).read_bytes() for f in ("out_text_document.bin", "out_text_document.idx")}
    monkeypatch.setattr(preprocess_module, "BATCH_DOCUMENTS", 10)
    calls = {"n": 0}
    original = preprocess_module._encode_batch

    def dies_on_third_batch(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated interruption")
        return original(*args)

    monkeypatch.setattr(preprocess_module, "_encode_batch", dies_on_third_batch)
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx",
                                            "out_text_document.meta.json"]
    assert {f: (tmp_path / f).read_bytes() for f in before} == before
    assert IndexedDataset(first.prefixes["text"]).num_documents == 50


def test_builtin_corpora_are_listed():
    corpora = list_builtin_corpora()
    assert {"shakespeare", "shakespeare-small", "kjv"} <= set(corpora)


def test_cli_preprocess_and_errors(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", [{"text": "Hello world"}])
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "domino", "preprocess", "--input", src, "--output-prefix",
                           str(tmp_path / "cli"), "--workers", "1"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "preprocess: 1 documents, 3 tokens in" in done.stdout and "tokens/s" in done.stdout
    assert IndexedDataset(str(tmp_path / "cli_text_document"))[0].tolist() == [15496, 995, 50256]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops}\n')
    done = subprocess.run([sys.executable, "-m", "domino", "preprocess", "--input", str(tmp_path / "bad.jsonl"),
                           "--output-prefix", str(tmp_path / "bad")], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "bad.jsonl:2: malformed JSON" in done.stderr
    listed = subprocess.run([sys.executable, "-m", "domino", "preprocess", "--list-builtin-corpora"],
                            capture_output=True, text=True, env=env)
    assert listed.returncode == 0 and "shakespeare-small" in listed.stdout


def test_cli_train_tokenizer_then_preprocess_with_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    src = tmp_path / "t.txt"
    src.write_text("\n\n".join(f"line {i} of the tiny training text" for i in range(100)))
    done = subprocess.run([sys.executable, "-m", "domino", "train-tokenizer", "--input", str(src), "--vocab-size",
                           "270", "--output", str(tmp_path / "tok")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "vocab size 270" in done.stdout and "'<|endoftext|>' = 0" in done.stdout
    done = subprocess.run([sys.executable, "-m", "domino", "preprocess", "--input", str(src), "--tokenizer",
                           str(tmp_path / "tok"), "--output-prefix", str(tmp_path / "p"), "--json"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["documents"] == 100 and result["vocab_size"] == 270 and result["eod"] == 0
    ds = IndexedDataset(result["prefixes"]["text"])
    assert ds.dtype == np.uint16 and int(ds[0][-1]) == 0 and int(np.asarray(ds.sizes).sum()) == result["tokens"]
    meta = json.load(open(result["prefixes"]["text"] + ".meta.json"))
    assert meta["vocab_size"] == 270 and meta["eod"] == 0 and meta["tokens"] == result["tokens"]
    assert meta["documents"] == 100 and meta["dtype"] == "uint16" and len(meta["tokenizer_sha256"]) == 64


def test_progress_bar_runs(tmp_path, capsys):
    result = preprocess(None, str(tmp_path / "p"), builtin_corpus="shakespeare-small", progress=True)
    assert result.documents == 70
    assert "preprocess" in capsys.readouterr().err  # tqdm drew on stderr
