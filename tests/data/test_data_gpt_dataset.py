"""GPTDataset samples, the index cache (hit, miss, corruption), the dataset builder, blending, mock data."""

import json
import os

import numpy as np
import pytest

from data_helpers import write_dataset
from domino.data import gpt_dataset as gpt_dataset_module
from domino.data.blending import BlendableDataset, build_blending_indices
from domino.config import ConfigError
from domino.config.data_specs import parse_data_prefix
from domino.data.dataset_builder import build_train_valid_test_datasets
from domino.data.errors import DataError
from domino.data.gpt_dataset import GPTDataset
from domino.data.indexed_dataset import IndexedDataset
from domino.data.mock import MockGPTDataset


def _corpus(tmp_path, name="c", count=40, seed=0, start=1, dtype=np.uint16):
    rng = np.random.default_rng(seed)
    docs = [list(range(start + 1000 * i, start + 1000 * i + int(n))) for i, n in
            enumerate(rng.integers(1, 30, size=count))]
    return write_dataset(str(tmp_path / name), docs, dtype), docs


def test_samples_are_windows_of_the_document_stream(tmp_path):
    prefix, docs = _corpus(tmp_path)
    ds = GPTDataset("train", prefix, np.arange(40), IndexedDataset(prefix), "1", 60, 16, 3, str(tmp_path / "cache"))
    stream = np.concatenate([docs[d] for d in ds.document_index])
    assert len(ds) >= 60
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        item = ds[i]["text"]
        assert item.dtype == np.int64 and item.shape == (17,)
        np.testing.assert_array_equal(item, stream[k * 16:k * 16 + 17])
    with pytest.raises(IndexError):
        ds[len(ds)]


def _count_builds(monkeypatch):
    calls = []
    original = gpt_dataset_module.build_indices

    def counting(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(gpt_dataset_module, "build_indices", counting)
    return calls


def test_cache_hit_miss_and_corruption(tmp_path, monkeypatch):
    prefix, _ = _corpus(tmp_path)
    indexed = IndexedDataset(prefix)
    cache = tmp_path / "cache"
    calls = _count_builds(monkeypatch)

    def make(samples=50, seed=1):
        return GPTDataset("train", prefix, np.arange(30), indexed, "3,1,0", samples, 8, seed, str(cache))

    first = make()
    expected = np.array(first.sample_index)  # a copy: the test below rewrites the mapped file in place
    assert len(calls) == 1 and len(os.listdir(cache)) == 4
    key = os.listdir(cache)[0].split("_")[0]
    second = make()
    assert len(calls) == 1  # hit
    np.testing.assert_array_equal(first.shuffle_index, second.shuffle_index)

    sample_file = cache / f"{key}_sample_idx.npy"
    original = sample_file.read_bytes()
    damages = [original[:-8], original[:-8] + bytes(8), original[:100] + b"\xff" + original[101:], b""]
    for damage in damages:  # truncated, overwritten, one byte changed, empty: detected and rebuilt
        sample_file.write_bytes(damage)
        before = len(calls)
        rebuilt = make()
        assert len(calls) == before + 1
        np.testing.assert_array_equal(rebuilt.sample_index, expected)
        assert sample_file.read_bytes() == original
    desc = cache / f"{key}_desc.json"
    desc.write_text("{garbage")
    before = len(calls)
    make()
    assert len(calls) == before + 1 and json.loads(desc.read_text())["description"]["seed"] == 1
    os.remove(cache / f"{key}_shuffle_idx.npy")
    make()
    assert len(calls) == before + 2

    before = len(calls)
    make(seed=2)
    make(samples=51)
    assert len(calls) == before + 2  # every determining input is part of the key
    assert not [f for f in os.listdir(cache) if ".tmp-" in f]


def test_cache_key_follows_the_data(tmp_path, monkeypatch):
    prefix, _ = _corpus(tmp_path)
    calls = _count_builds(monkeypatch)
    build_train_valid_test_datasets([prefix], "1", [20, 0, 0], 8, 1, True)
    assert os.path.isdir(tmp_path / "index-cache")  # default: beside the data
    write_dataset(prefix, [[1, 2, 3]] * 50)  # the data changes under the same name
    os.utime(prefix + ".idx", ns=(1, 1))
    train, _, _ = build_train_valid_test_datasets([prefix], "1", [20, 0, 0], 8, 1, True)
    assert len(calls) == 2
    assert set(np.unique(train[0]["text"])) <= {1, 2, 3}


def test_builder_splits_and_empty_splits(tmp_path):
    prefix, _ = _corpus(tmp_path)
    train, valid, test = build_train_valid_test_datasets([prefix], "30,10,0", [40, 5, 5], 8, 1, True,
                                                         data_cache_path=str(tmp_path / "cache"))
    assert test is None and len(train) >= 40 and len(valid) >= 5
    assert set(train.document_index.tolist()) == set(range(30))
    assert set(valid.document_index.tolist()) == set(range(30, 40))
    train, valid, test = build_train_valid_test_datasets(prefix, "30,10,0", [40, 0, 0], 8, 1, False)
    assert valid is None and test is None and train is not None


def test_builder_weighted_blend(tmp_path):
    a, _ = _corpus(tmp_path, "a", start=1)
    b, _ = _corpus(tmp_path, "b", start=500_000, dtype=np.int32)
    train, valid, test = build_train_valid_test_datasets(["0.25", a, "0.75", b], "9,1,0", [400, 20, 0], 8, 1, True)
    assert isinstance(train, BlendableDataset) and test is None
    assert len(train) == int(np.ceil(400 * 0.25 * 1.005)) + int(np.ceil(400 * 0.75 * 1.005))
    from_b = sum(int(train[i]["text"][0] >= 500_000) for i in range(len(train)))
    assert abs(from_b / len(train) - 0.75) < 0.01
    np.testing.assert_array_equal(train.dataset_index, build_blending_indices([0.25, 0.75], len(train))[0])


def test_builder_separate_split_prefixes(tmp_path):
    a, _ = _corpus(tmp_path, "a")
    b, _ = _corpus(tmp_path, "b", count=10)
    train, valid, test = build_train_valid_test_datasets(None, "949,50,1", [30, 10, 0], 8, 1, True,
                                                         train_data_prefix=[a], valid_data_prefix=[b])
    assert test is None
    assert set(train.document_index.tolist()) == set(range(40))
    assert set(valid.document_index.tolist()) == set(range(10))
    with pytest.raises(DataError, match="no data"):
        build_train_valid_test_datasets(None, "1", [1, 0, 0], 8, 1, True)


def test_builder_errors(tmp_path):
    with pytest.raises(DataError, match="missing.bin"):
        build_train_valid_test_datasets([str(tmp_path / "missing")], "1", [1, 0, 0], 8, 1, True)
    with pytest.raises(ConfigError, match="WEIGHT PREFIX|weight before every"):
        parse_data_prefix(["0.5", "a", "b"])
    assert parse_data_prefix(["0.3", "x", "0.7", "y"]) == (["x", "y"], [0.3, 0.7])
    assert parse_data_prefix("x") == (["x"], None)


def _reference_blend(weights, size):
    weights = [w / sum(weights) for w in weights]
    taken = [0] * len(weights)
    out = []
    for i in range(size):
        x = max(float(i), 1.0)
        errors = [w * x - t for w, t in zip(weights, taken)]
        best = errors.index(max(errors))
        out.append((best, taken[best]))
        taken[best] += 1
    return out


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.7, 0.3], [1, 3], [0.1, 0.9], [1, 0], [0.123, 0.877],
                                     [1, 1, 1], [0.2, 0.3, 0.5], [5, 1, 1, 3]])
def test_blending_indices_match_megatron(weights):
    dataset_index, sample_index = build_blending_indices(weights, 3000)
    expected = _reference_blend(weights, 3000)
    assert list(zip(dataset_index.tolist(), sample_index.tolist())) == expected
    assert dataset_index.dtype == np.uint8 and sample_index.dtype == np.int64


def test_blending_many_random_two_way_weights():
    rng = np.random.default_rng(5)
    for _ in range(40):
        w = rng.random(2).tolist()
        dataset_index, sample_index = build_blending_indices(w, 1500)
        assert list(zip(dataset_index.tolist(), sample_index.tolist())) == _reference_blend(w, 1500)


def test_mock_dataset():
    ds = MockGPTDataset(10, 16, 100, seed=3)
    assert len(ds) == 10 and ds[0]["text"].shape == (17,) and ds[0]["text"].dtype == np.int64
    np.testing.assert_array_equal(ds[4]["text"], MockGPTDataset(10, 16, 100, seed=3)[4]["text"])
    assert not np.array_equal(ds[4]["text"], ds[5]["text"])
    assert ds[9]["text"].max() < 100 and ds[9]["text"].min() >= 0
    with pytest.raises(IndexError):
        ds[10]


def test_unwritable_cache_still_gives_indices(tmp_path):
    prefix, _ = _corpus(tmp_path)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    ds = GPTDataset("train", prefix, np.arange(40), IndexedDataset(prefix), "1", 20, 8, 1, str(blocker / "cache"))
    assert len(ds) >= 20 and ds[0]["text"].shape == (9,)


def test_blend_indices_are_cached(tmp_path, monkeypatch):
    from domino.data import blending

    a, _ = _corpus(tmp_path, "a")
    b, _ = _corpus(tmp_path, "b", seed=1)
    calls = []
    original = blending.build_blending_indices
    monkeypatch.setattr(blending, "build_blending_indices", lambda *args: calls.append(1) or original(*args))
    spec = ["1", a, "2", b, "3", a]  # three datasets: the exact greedy loop
    first, _, _ = build_train_valid_test_datasets(spec, "1", [90, 0, 0], 8, 1, True, data_cache_path=str(tmp_path / "c"))
    second, _, _ = build_train_valid_test_datasets(spec, "1", [90, 0, 0], 8, 1, True, data_cache_path=str(tmp_path / "c"))
    assert len(calls) == 1
    np.testing.assert_array_equal(first.dataset_index, second.dataset_index)
    assert list(zip(second.dataset_index.tolist(), second.dataset_sample_index.tolist())) == \
        _reference_blend([1, 2, 3], len(second))
    assert all(np.array_equal(first[i]["text"], second[i]["text"]) for i in range(len(first)))
