"""domino merge-datasets: shards preprocessed apart and merged give the one-run bytes; checks; atomicity."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from domino.data import merge as merge_module
from domino.data.errors import DataError
from domino.data.merge import merge_datasets
from domino.data.preprocess import preprocess
from domino.data.provenance import meta_path, read_meta
from domino.data.tokenizer_training import train_tokenizer
from data_helpers import write_dataset

# Sentence lists (several sequences per document) and empty documents exercise both index offsets.
RECORDS = ([{"text": [f"Part {i} opens.", f" It ends {i}."] if i % 3 else f"Plain document {i} \u00e9"}
            for i in range(60)] + [{"text": f"Row {i}: " + "lorem " * (i % 9)} for i in range(40)])
RECORDS[5]["text"] = ""
RECORDS[61]["text"] = ""


def _lines(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _pair(prefix):
    return open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read()


@pytest.fixture
def shard_prefixes(tmp_path):
    """The plain one-run dataset, and the three shards (gz, zst, parquet) preprocessed one by one."""
    (tmp_path / "all.jsonl").write_bytes(_lines(RECORDS))
    preprocess([str(tmp_path / "all.jsonl")], str(tmp_path / "whole"))
    (tmp_path / "s0.jsonl.gz").write_bytes(gzip.compress(_lines(RECORDS[:30])))
    (tmp_path / "s1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines(RECORDS[30:60])))
    pq.write_table(pa.table({"text": [r["text"] for r in RECORDS[60:]]}), str(tmp_path / "s2.parquet"))
    shards = tmp_path / "shards"
    for index, name in enumerate(("s0.jsonl.gz", "s1.jsonl.zst", "s2.parquet")):
        preprocess([str(tmp_path / name)], str(shards / f"part{index}"))
    return tmp_path, [str(shards / f"part{i}_text_document") for i in range(3)]


def test_shards_merged_give_the_one_run_bytes(shard_prefixes, monkeypatch):
    tmp_path, prefixes = shard_prefixes
    monkeypatch.setattr(merge_module, "BLOCK_ITEMS", 7)  # many blocks per input section
    result = merge_datasets(prefixes, str(tmp_path / "merged"))
    assert _pair(tmp_path / "merged") == _pair(tmp_path / "whole_text_document")
    assert result.documents == len(RECORDS) and result.inputs == prefixes
    assert result.bytes == sum(len(b) for b in _pair(tmp_path / "merged"))
    # The merged sidecar equals the one a single preprocess run writes, so merges can be merged again.
    assert read_meta(str(tmp_path / "merged")) == read_meta(str(tmp_path / "whole_text_document"))
    # Megatron's form of the input: a directory, every dataset in it in sorted order.
    merge_datasets([os.path.dirname(prefixes[0])], str(tmp_path / "from_dir"))
    assert _pair(tmp_path / "from_dir") == _pair(tmp_path / "whole_text_document")
    # Merging a merge with the rest again gives the same bytes (associativity).
    merge_datasets(prefixes[:2], str(tmp_path / "first_two"))
    merge_datasets([str(tmp_path / "first_two"), prefixes[2]], str(tmp_path / "again"))
    assert _pair(tmp_path / "again") == _pair(tmp_path / "whole_text_document")


def test_dtype_and_tokenizer_must_agree(tmp_path, shard_prefixes):
    _, prefixes = shard_prefixes
    write_dataset(str(tmp_path / "wide"), [[1, 2, 70000]], dtype=np.int32)
    with pytest.raises(DataError, match="wide has token dtype int32 but .*part0_text_document has uint16"):
        merge_datasets([prefixes[0], str(tmp_path / "wide")], str(tmp_path / "out"))
    (tmp_path / "t.txt").write_text("\n\n".join(f"line {i} of a small text" for i in range(60)))
    tokenizer = train_tokenizer([str(tmp_path / "t.txt")], 270, str(tmp_path / "tok"))
    assert tokenizer.vocab_size == 270
    preprocess([str(tmp_path / "t.txt")], str(tmp_path / "own"), tokenizer=str(tmp_path / "tok"))
    with pytest.raises(DataError, match="own_text_document and .*part0_text_document were made with different "
                                        "tokenizers \\(tokenizer_sha256: .*; datasets of different tokenizers"):
        merge_datasets([prefixes[0], str(tmp_path / "own_text_document")], str(tmp_path / "out"))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(("out", ".out"))]


def test_input_checks_before_any_work(tmp_path, shard_prefixes):
    _, prefixes = shard_prefixes
    with pytest.raises(DataError, match="--input .*nothing: .*nothing.idx not found"):
        merge_datasets([prefixes[0], str(tmp_path / "nothing")], str(tmp_path / "out"))
    with pytest.raises(DataError, match="is also an input"):
        merge_datasets(prefixes, prefixes[1])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="directory holds no .idx/.bin dataset"):
        merge_datasets([str(tmp_path / "empty")], str(tmp_path / "out"))
    meta = json.load(open(meta_path(prefixes[1])))
    meta["documents"] += 1
    json.dump(meta, open(meta_path(prefixes[1]), "w"))
    with pytest.raises(DataError, match="part1_text_document.meta.json does not describe .*stale sidecar"):
        merge_datasets(prefixes, str(tmp_path / "out"))
    with open(prefixes[2] + ".bin", "ab") as handle:
        handle.write(b"\0\0")
    with pytest.raises(DataError, match="part2_text_document.idx: the pointers and sizes describe"):
        merge_datasets([prefixes[2]], str(tmp_path / "out"))


def test_datasets_without_sidecars_merge_by_dtype_only(tmp_path):
    a = write_dataset(str(tmp_path / "a"), [[1, 2, 3], [4]])
    b = write_dataset(str(tmp_path / "b"), [[5, 6]])
    write_dataset(str(tmp_path / "ab"), [[1, 2, 3], [4], [5, 6]])
    result = merge_datasets([a, b], str(tmp_path / "merged"))
    assert _pair(tmp_path / "merged") == _pair(tmp_path / "ab") and result.tokens == 6
    assert read_meta(str(tmp_path / "merged")) is None  # nothing to vouch for the tokenizer


def test_failed_merge_keeps_the_old_output_and_leaves_no_temporaries(tmp_path, shard_prefixes, monkeypatch):
    _, prefixes = shard_prefixes
    out = tmp_path / "merged"
    merge_datasets(prefixes[:2], str(out))
    before = _pair(out)
    calls = {"n": 0}
    original = merge_module._copy_section

    def dies_on_fourth(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt("simulated interruption")
        return original(*args, **kwargs)

    monkeypatch.setattr(merge_module, "_copy_section", dies_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        merge_datasets(prefixes, str(out))
    assert _pair(out) == before
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".merged")]


def test_cli_merge_datasets(tmp_path, shard_prefixes):
    _, prefixes = shard_prefixes
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "domino", "merge-datasets", "--input", *prefixes,
                           "--output-prefix", str(tmp_path / "cli")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert f"merged 3 datasets: {len(RECORDS)} documents" in done.stdout and "MB/s" in done.stdout
    assert _pair(tmp_path / "cli") == _pair(tmp_path / "whole_text_document")
    done = subprocess.run([sys.executable, "-m", "domino", "merge-datasets", "--input", str(tmp_path / "none"),
                           "--output-prefix", str(tmp_path / "x")], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "none.idx not found" in done.stderr
