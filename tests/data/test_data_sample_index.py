"""GPTDataset indices against a slow, obviously-correct transcription of Megatron's Python/C++ loops."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domino.config import ConfigError
from domino.config.data_specs import parse_split
from domino.data.sample_index import build_indices, num_epochs, split_boundaries


# ---- the reference: Megatron-LM's gpt_dataset.py / helpers.cpp, loop by loop -------------------------

def ref_num_epochs(tokens_per_epoch, seq_length, num_samples):
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return epochs


def ref_doc_idx(documents, epochs, rng, separate_last):
    if not separate_last or epochs == 1:
        doc_idx = np.mgrid[0:epochs, 0:len(documents)][1]
        doc_idx[:] = documents
        doc_idx = doc_idx.reshape(-1).astype(np.int32)
        rng.shuffle(doc_idx)
        return doc_idx
    first = ref_doc_idx(documents, epochs - 1, rng, False)
    last = ref_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def ref_sample_idx(sizes, doc_idx, seq_length, epochs, tokens_per_epoch):
    num_samples = (epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros([num_samples + 1, 2], dtype=np.int64)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return sample_idx


def ref_shuffle_idx(num_samples, total_size, rng):
    first = np.arange(0, num_samples, dtype=np.uint32)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.uint32)
    rng.shuffle(last)
    return np.concatenate((first, last))


def ref_indices(sizes, documents, seq_length, num_samples, seed):
    tokens_per_epoch = int(np.sum(sizes[documents]))
    epochs = ref_num_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate = False
    if epochs > 1:
        before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_samples = num_samples - before_last
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = last_samples < int(0.80 * per_epoch)
    doc_idx = ref_doc_idx(documents, epochs, rng, separate)
    sample_idx = ref_sample_idx(sizes, doc_idx, seq_length, epochs, tokens_per_epoch)
    count = before_last if separate else sample_idx.shape[0] - 1
    shuffle_idx = ref_shuffle_idx(count, sample_idx.shape[0] - 1, rng)
    return doc_idx, sample_idx, shuffle_idx, separate


def ref_split(splits_string, size):
    splits = [float(s) for s in splits_string.split(",")]
    while len(splits) < 3:
        splits.append(0.0)
    splits = [s / sum(splits[:3]) for s in splits[:3]]
    index = [0]
    for i, split in enumerate(splits):
        index.append(index[i] + int(round(split * float(size))))
    diff = index[-1] - size
    return [index[0]] + [i - diff for i in index[1:]]


# ---- tests --------------------------------------------------------------------------------------------

corpora = st.lists(st.integers(0, 40), min_size=1, max_size=30).filter(lambda s: sum(s) > 0)


@settings(max_examples=300, deadline=None)
@given(sizes=corpora, seq_length=st.integers(1, 50), num_samples=st.integers(0, 120), seed=st.integers(0, 2**31),
       data=st.data())
def test_indices_equal_the_reference(sizes, seq_length, num_samples, seed, data):
    sizes = np.array(sizes, dtype=np.int32)
    start = data.draw(st.integers(0, len(sizes) - 1))
    stop = data.draw(st.integers(start + 1, len(sizes)))
    documents = np.arange(start, stop, dtype=np.int32)
    if sizes[documents].sum() == 0:
        return
    ours = build_indices(sizes, documents, seq_length, num_samples, seed)
    doc_idx, sample_idx, shuffle_idx, _ = ref_indices(sizes, documents, seq_length, num_samples, seed)
    np.testing.assert_array_equal(ours.document_index, doc_idx)
    np.testing.assert_array_equal(ours.sample_index, sample_idx)
    np.testing.assert_array_equal(ours.shuffle_index, shuffle_idx)
    assert ours.document_index.dtype == np.int32 and ours.shuffle_index.dtype == np.uint32
    assert len(ours.shuffle_index) >= num_samples


def test_separate_last_epoch_happens_and_matches():
    sizes = np.full(10, 11, dtype=np.int32)  # 110 tokens per epoch, 10 samples of 10 per epoch (+1 shared)
    # 12 samples: 2 epochs, the last supplies 2 < 0.8 * 10 -> shuffled apart
    ours = build_indices(sizes, np.arange(10), 10, 12, 7)
    doc_idx, sample_idx, shuffle_idx, separate = ref_indices(sizes, np.arange(10, dtype=np.int32), 10, 12, 7)
    assert separate
    np.testing.assert_array_equal(ours.document_index, doc_idx)
    np.testing.assert_array_equal(ours.shuffle_index, shuffle_idx)
    assert sorted(ours.document_index[:10]) == list(range(10)) and sorted(ours.document_index[10:]) == list(range(10))
    assert set(ours.shuffle_index[:10].tolist()) == set(range(10))  # first-epoch samples shuffled among themselves


@pytest.mark.parametrize("tokens,seq,samples", [(100, 10, 0), (100, 10, 9), (100, 10, 10), (7, 3, 50), (1, 1, 5)])
def test_num_epochs_matches_the_loop(tokens, seq, samples):
    assert num_epochs(tokens, seq, samples) == ref_num_epochs(tokens, seq, samples)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.integers(0, 1000), min_size=1, max_size=3).filter(lambda p: sum(p) > 0),
       size=st.integers(0, 5000))
def test_split_boundaries_match_megatron(parts, size):
    text = ",".join(map(str, parts))
    assert split_boundaries(text, size) == ref_split(text, size)


def test_split_strings():
    assert split_boundaries("949,50,1", 1000) == [0, 949, 999, 1000]
    assert split_boundaries("1", 10) == [0, 10, 10, 10]
    assert parse_split("2/1/1") == [0.5, 0.25, 0.25]
    with pytest.raises(ConfigError, match="--split"):
        parse_split("a,b")
    with pytest.raises(ConfigError, match="positive sum"):
        parse_split("0,0,0")


def test_deterministic_and_seed_dependent():
    sizes = np.random.default_rng(0).integers(1, 200, size=300).astype(np.int32)
    a = build_indices(sizes, np.arange(300), 64, 500, 1)
    b = build_indices(sizes, np.arange(300), 64, 500, 1)
    c = build_indices(sizes, np.arange(300), 64, 500, 2)
    np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
    np.testing.assert_array_equal(a.sample_index, b.sample_index)
    assert not np.array_equal(a.document_index, c.document_index)
