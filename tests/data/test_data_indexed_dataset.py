"""The MMIDIDX format, byte for byte: writer output, a reader on hand-built files, validation, fuzzing."""

import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_helpers import spec_index_bytes, write_dataset
from domino.data.errors import DataError
from domino.data.indexed_dataset import DTYPES, IndexedDataset, IndexedDatasetWriter, read_index, token_dtype

DOCS = [[5, 6, 7], [8], [9, 10, 11, 12], []]


def test_writer_bytes_match_the_spec(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), DOCS, np.uint16)
    idx = (tmp_path / "d.idx").read_bytes()
    sizes = [3, 1, 4, 0]
    pointers = [0, 6, 8, 16]  # byte offsets, uint16 = 2 bytes per token
    assert idx == spec_index_bytes(8, sizes, pointers, [0, 1, 2, 3, 4])
    assert (tmp_path / "d.bin").read_bytes() == np.array([5, 6, 7, 8, 9, 10, 11, 12], "<u2").tobytes()
    assert IndexedDataset(prefix).num_tokens == 8


def test_reader_on_a_hand_built_file(tmp_path):
    # two documents: the first made of two sequences, int32 tokens
    tokens = np.array([1, 2, 3, 40000, 70000, 6], "<i4")
    (tmp_path / "h.bin").write_bytes(tokens.tobytes())
    (tmp_path / "h.idx").write_bytes(spec_index_bytes(4, [2, 1, 3], [0, 8, 12], [0, 2, 3]))
    ds = IndexedDataset(str(tmp_path / "h"))
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 2
    assert ds[0].tolist() == [1, 2] and ds[2].tolist() == [40000, 70000, 6]
    assert ds.get(2, offset=1, length=1).tolist() == [70000]
    assert ds.get(2, offset=1).tolist() == [70000, 6]
    assert ds.get_document(0).tolist() == [1, 2, 3]
    assert ds.get_document(1).tolist() == [40000, 70000, 6]
    assert ds.sizes.tolist() == [2, 1, 3] and ds.document_index.tolist() == [0, 2, 3]


def test_multimodal_modes_section_is_accepted(tmp_path):
    (tmp_path / "m.bin").write_bytes(np.array([1, 2], "<u2").tobytes())
    (tmp_path / "m.idx").write_bytes(spec_index_bytes(8, [2], [0], [0, 1], modes=b"\x00"))
    assert IndexedDataset(str(tmp_path / "m"))[0].tolist() == [1, 2]


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPES[code]
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, size=n).astype(dtype) for n in (4, 0, 7, 1)]
    with IndexedDatasetWriter(str(tmp_path / "r"), dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    assert (tmp_path / "r.idx").read_bytes()[17] == code
    ds = IndexedDataset(str(tmp_path / "r"), mmap_warmup=True)
    assert ds.dtype == dtype
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)


def test_token_dtype_follows_megatron():
    assert token_dtype(50257) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(128256) == np.int32


def test_empty_dataset(tmp_path):
    prefix = write_dataset(str(tmp_path / "e"), [], np.uint16)
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


def test_writer_abort_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "a"), np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "o"), np.uint16)
    with pytest.raises(ValueError, match="do not fit"):
        writer.add_document([70000])
    writer.abort()


def _corrupt(tmp_path, offset, data):
    prefix = write_dataset(str(tmp_path / "c"), DOCS, np.uint16)
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[offset:offset + len(data)] = data
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    return prefix


@pytest.mark.parametrize("offset,data,message", [
    (0, b"XXIDIDX\x00\x00", "bad magic"),
    (9, struct.pack("<Q", 2), "unsupported version 2"),
    (17, b"\x09", "unknown dtype code 9"),
    (18, struct.pack("<Q", 5), "does not match the header's sequence count"),
    (34, struct.pack("<i", -1), "negative sequence length"),
    (34, struct.pack("<i", 4), "pointers\\[1\\]"),
    (34 + 16 + 8, struct.pack("<q", 7), "pointers\\[1\\] = 7"),
    (34 + 48, struct.pack("<q", 1), "document_index starts at 1"),
    (34 + 48 + 32, struct.pack("<q", 9), "document_index ends at 9"),
    (34 + 48 + 8, struct.pack("<q", 3), "not non-decreasing"),
    # Differences that wrap around in int64 look non-decreasing (found by the fuzz test below).
    (34 + 48 + 8, struct.pack("<qq", 0x7000000000000000, -0x7000000000000000),
     "document_index\\[1\\] = 8070450532247928832 is outside \\[0, 4\\]"),
])
def test_corrupt_index_fields_are_named(tmp_path, offset, data, message):
    prefix = _corrupt(tmp_path, offset, data)
    with pytest.raises(DataError, match=message) as info:
        IndexedDataset(prefix)
    assert "c.idx" in str(info.value)


def test_truncated_files(tmp_path):
    prefix = write_dataset(str(tmp_path / "t"), DOCS, np.uint16)
    raw = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(raw[:-2])
    with pytest.raises(DataError, match="the .bin file has 14 bytes"):
        IndexedDataset(prefix)
    (tmp_path / "t.bin").write_bytes(raw)
    idx = (tmp_path / "t.idx").read_bytes()
    (tmp_path / "t.idx").write_bytes(idx[:20])
    with pytest.raises(DataError, match="truncated header"):
        IndexedDataset(prefix)
    (tmp_path / "t.idx").write_bytes(idx[:-1])
    with pytest.raises(DataError, match="file size"):
        IndexedDataset(prefix)
    os.remove(tmp_path / "t.idx")
    with pytest.raises(DataError, match="t.idx: cannot open"):
        IndexedDataset(prefix)
    os.remove(tmp_path / "t.bin")
    with pytest.raises(DataError, match="t.bin: cannot open"):
        IndexedDataset(prefix)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_never_crashes(tmp_path_factory, data):
    """Random mutations of a valid pair either load consistently or raise DataError; nothing else."""
    directory = tmp_path_factory.mktemp("fuzz")
    prefix = write_dataset(str(directory / "f"), DOCS, np.uint16)
    idx = bytearray((directory / "f.idx").read_bytes())
    binary = bytearray((directory / "f.bin").read_bytes())
    target = data.draw(st.sampled_from(["idx", "bin"]))
    buffer = idx if target == "idx" else binary
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "overwrite"]))
    if action == "flip" and buffer:
        position = data.draw(st.integers(0, len(buffer) - 1))
        buffer[position] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del buffer[data.draw(st.integers(0, len(buffer))):]
    elif action == "extend":
        buffer.extend(data.draw(st.binary(min_size=1, max_size=64)))
    else:
        position = data.draw(st.integers(0, len(buffer)))
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        buffer[position:position + len(chunk)] = chunk
    (directory / "f.idx").write_bytes(bytes(idx))
    (directory / "f.bin").write_bytes(bytes(binary))
    try:
        ds = IndexedDataset(prefix)
    except DataError:
        return
    # whatever loaded must be self-consistent: every sequence and document readable within the file
    total = sum(len(ds[i]) for i in range(len(ds)))
    assert total == ds.num_tokens
    for d in range(ds.num_documents):
        ds.get_document(d)


@settings(max_examples=100, deadline=None)
@given(header=st.binary(min_size=0, max_size=120))
def test_fuzz_arbitrary_index_bytes(tmp_path_factory, header):
    directory = tmp_path_factory.mktemp("raw")
    (directory / "g.bin").write_bytes(b"\x00" * 8)
    (directory / "g.idx").write_bytes(b"MMIDIDX\x00\x00" + header)
    try:
        read_index(str(directory / "g.idx"), 8)
    except DataError:
        pass


def test_pickles_by_path_not_by_content(tmp_path):
    import pickle

    prefix = write_dataset(str(tmp_path / "p"), [list(range(1000))] * 20, np.uint16)
    ds = IndexedDataset(prefix)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # 40 KB of tokens are not in the pickle
    np.testing.assert_array_equal(pickle.loads(blob)[3], ds[3])


@pytest.mark.parametrize("block", [1, 2, 3])
def test_blockwise_validation(tmp_path, monkeypatch, block):
    from domino.data import index_checks

    monkeypatch.setattr(index_checks, "VALIDATION_BLOCK", block)
    docs = [[1] * n for n in (3, 1, 4, 1, 5, 9, 2)]
    prefix = write_dataset(str(tmp_path / "b"), docs, np.uint16)
    assert [len(IndexedDataset(prefix)[i]) for i in range(7)] == [3, 1, 4, 1, 5, 9, 2]
    raw = bytearray((tmp_path / "b.idx").read_bytes())
    raw[34 + 28 + 8 * 5:34 + 28 + 8 * 6] = struct.pack("<q", 30)  # pointers[5] should be 28
    (tmp_path / "b.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="pointers\\[5\\] = 30 but the sequences before it end at byte 28"):
        IndexedDataset(prefix)


def test_iter_documents_with_page_release(tmp_path):
    docs = [list(range(n, n + 3000)) for n in range(0, 30000, 3000)]
    prefix = write_dataset(str(tmp_path / "i"), docs, np.uint16)
    ds = IndexedDataset(prefix)
    seen = [d.copy() for d in ds.iter_documents(release_bytes=4096)]
    assert [d.tolist() for d in seen] == docs
    ds.release_memory()
    assert ds.get_document(3).tolist() == docs[3]  # still readable after the pages were dropped
