"""Compressed and columnar inputs: the same documents give the same bytes as plain .jsonl/.txt."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from domino.data import input_files
from domino.data.errors import DataError
from domino.data.preprocess import preprocess
from domino.data.input_files import expand_inputs
from domino.data.text_inputs import read_documents

RECORDS = [{"text": f"Document {i}: caf\u00e9 \u2603 " + "word " * (i % 17) + ("\n\nsecond paragraph" if i % 5 else ""),
            "title": f"Title {i}"} for i in range(240)]
RECORDS[7]["text"] = ""  # an empty document stays an empty index entry in every format


def _lines(records):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def _zst_two_frames(data: bytes) -> bytes:
    half = len(data) // 2
    cut = data.index(b"\n", half) + 1  # frames split at a line boundary, as appended shards would be
    compressor = zstandard.ZstdCompressor()
    return compressor.compress(data[:cut]) + compressor.compress(data[cut:])


def _parquet(path, records, row_group_size=25):
    table = pa.table({key: [r[key] for r in records] for key in records[0]})
    pq.write_table(table, path, row_group_size=row_group_size)


def _files(prefix):
    return [open(f"{prefix}_{key}_document.{ext}", "rb").read() for key in ("text", "title") for ext in ("bin", "idx")]


@pytest.fixture
def shards(tmp_path, monkeypatch):
    """The corpus as one plain .jsonl, and split over a .jsonl.gz, a two-frame .jsonl.zst and a .parquet."""
    monkeypatch.setattr(input_files, "PARQUET_BATCH_ROWS", 16)  # several record batches per row group
    (tmp_path / "plain.jsonl").write_bytes(_lines(RECORDS))
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "a.jsonl.gz").write_bytes(gzip.compress(_lines(RECORDS[:80])))
    (parts / "b.jsonl.zst").write_bytes(_zst_two_frames(_lines(RECORDS[80:170])))
    _parquet(str(parts / "c.parquet"), RECORDS[170:])
    (parts / "README.md").write_text("not data: skipped with a warning when the directory is the input\n")
    return tmp_path


def test_gz_zst_and_parquet_shards_give_the_plain_jsonl_bytes(shards):
    keys = ["text", "title"]
    plain = preprocess([str(shards / "plain.jsonl")], str(shards / "plain"), json_keys=keys)
    parts = [str(shards / "parts" / name) for name in ("a.jsonl.gz", "b.jsonl.zst", "c.parquet")]
    mixed = preprocess(parts, str(shards / "mixed"), json_keys=keys, workers=2)
    assert _files(shards / "mixed") == _files(shards / "plain")
    assert mixed.documents == plain.documents == len(RECORDS) and mixed.empty_documents == 1
    # A directory (sorted, unsupported files skipped) and a glob name the same shards in the same order.
    preprocess([str(shards / "parts")], str(shards / "dir"), json_keys=keys)
    preprocess([str(shards / "parts" / "[abc].*")], str(shards / "glob"), json_keys=keys)
    assert _files(shards / "dir") == _files(shards / "glob") == _files(shards / "plain")


def test_progress_bytes_add_up_to_the_files_on_disk(shards):
    files = expand_inputs([str(shards / "parts")])
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.jsonl.gz", "b.jsonl.zst", "c.parquet"]
    documents = list(read_documents(files, ["text"]))
    assert len(documents) == len(RECORDS)
    assert sum(d.nbytes for d in documents) == sum((shards / "parts" / n).stat().st_size
                                                   for n in ("a.jsonl.gz", "b.jsonl.zst", "c.parquet"))
    assert documents[-1].source.endswith("c.parquet") and documents[-1].line == len(RECORDS) - 170


def test_compressed_txt_matches_plain_txt(tmp_path):
    text = "first block\nline two\n\n\nsecond block\n\n" * 50
    (tmp_path / "p.txt").write_text(text)
    (tmp_path / "g.txt.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "z.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    outputs = []
    for name in ("p.txt", "g.txt.gz", "z.txt.zst"):
        preprocess([str(tmp_path / name)], str(tmp_path / name.split(".")[0]))
        outputs.append(open(tmp_path / f"{name.split('.')[0]}_text_document.idx", "rb").read()
                       + open(tmp_path / f"{name.split('.')[0]}_text_document.bin", "rb").read())
    assert outputs[0] == outputs[1] == outputs[2]


def test_parquet_list_column_is_megatrons_sentence_list(tmp_path):
    records = [{"text": ["One sentence.", " Two."]}, {"text": []}, {"text": ["Three"]}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.table({"text": pa.array([r["text"] for r in records], type=pa.list_(pa.string()))}),
                   str(tmp_path / "s.parquet"))
    preprocess([str(tmp_path / "s.jsonl")], str(tmp_path / "j"))
    preprocess([str(tmp_path / "s.parquet")], str(tmp_path / "q"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"j_text_document.{ext}").read_bytes() == (tmp_path / f"q_text_document.{ext}").read_bytes()


def test_bad_compressed_and_parquet_inputs_name_the_file(tmp_path):
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(_lines(RECORDS[:50]))[:-30])
    with pytest.raises(DataError, match="cut.jsonl.gz: cannot decompress \\(gzip\\)"):
        preprocess([str(tmp_path / "cut.jsonl.gz")], str(tmp_path / "o"))
    (tmp_path / "bad.jsonl.zst").write_bytes(b"this is not zstd at all\n")
    with pytest.raises(DataError, match="bad.jsonl.zst: cannot decompress \\(zstd\\)"):
        preprocess([str(tmp_path / "bad.jsonl.zst")], str(tmp_path / "o"))
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), str(tmp_path / "cols.parquet"))
    with pytest.raises(DataError, match="cols.parquet: no column 'text' \\(columns: body, n\\)"):
        preprocess([str(tmp_path / "cols.parquet")], str(tmp_path / "o"))
    with pytest.raises(DataError, match="cols.parquet: column 'n' has type int64, expected a string"):
        preprocess([str(tmp_path / "cols.parquet")], str(tmp_path / "o"), json_keys=["n"])
    (tmp_path / "fake.parquet").write_text("{}")
    with pytest.raises(DataError, match="fake.parquet: not a readable Parquet file"):
        preprocess([str(tmp_path / "fake.parquet")], str(tmp_path / "o"))
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), str(tmp_path / "nulls.parquet"))
    with pytest.raises(DataError, match="nulls.parquet:row 3: key 'text' holds null"):
        preprocess([str(tmp_path / "nulls.parquet")], str(tmp_path / "o"))
    skipped = preprocess([str(tmp_path / "nulls.parquet")], str(tmp_path / "o"), skip_bad_lines=True)
    assert skipped.documents == 3 and skipped.skipped_lines == 1
    (tmp_path / "x.csv.gz").write_bytes(gzip.compress(b"a,b\n"))
    with pytest.raises(DataError, match="x.csv.gz: unsupported file type \\(expected .jsonl/.json/.txt"):
        preprocess([str(tmp_path / "x.csv.gz")], str(tmp_path / "o"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="input directory .*empty holds no"):
        preprocess([str(tmp_path / "empty")], str(tmp_path / "o"))
