"""Masks and position ids for every flag combination; get_batch without distributed; the resumable loader."""

import itertools

import numpy as np
import pytest
import torch

from domino.config import DataConfig
from domino.data.batch import dense_document_mask, get_batch, get_ltor_masks_and_position_ids
from domino.data.errors import DataError
from domino.data.loader import MegatronPretrainingSampler, build_pretraining_data_loader
from domino.data.mock import MockGPTDataset

EOD = 0
DATA = torch.tensor([[5, 0, 6, 7, 0, 8],
                     [1, 2, 3, 4, 5, 6]])
# hand-worked: row 0 holds documents [5 0] [6 7 0] [8]
RESET_POSITIONS = [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
EOD_LOSS = [[1, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]]
ALLOWED_ROW0 = [  # query (row) may attend key (column)
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [0, 0, 1, 0, 0, 0],
    [0, 0, 1, 1, 0, 0],
    [0, 0, 1, 1, 1, 0],
    [0, 0, 0, 0, 0, 1],
]
CAUSAL = np.tril(np.ones((6, 6), dtype=int)).tolist()


def megatron_reference(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's get_ltor_masks_and_position_ids, loops and all (mask always materialised)."""
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length))).view(
        att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token].clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= (i + 1 - prev_index)
                    prev_index = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


FLAGS = list(itertools.product([False, True], repeat=3))


@pytest.mark.parametrize("reset_position_ids,reset_attention_mask,eod_mask_loss", FLAGS)
def test_hand_worked_masks(reset_position_ids, reset_attention_mask, eod_mask_loss):
    mask, loss, positions = get_ltor_masks_and_position_ids(DATA, EOD, reset_position_ids, reset_attention_mask,
                                                            eod_mask_loss)
    expected_positions = RESET_POSITIONS if reset_position_ids else [list(range(6))] * 2
    assert positions.tolist() == expected_positions and positions.dtype == torch.long
    assert loss.tolist() == (EOD_LOSS if eod_mask_loss else [[1] * 6] * 2) and loss.dtype == torch.float
    if reset_attention_mask:  # document starts [b, s], never the [b, 1, s, s] mask
        assert mask.dtype == torch.long and mask.shape == (2, 6)
        mask = dense_document_mask(mask)
        assert mask.dtype == torch.bool and mask.shape == (2, 1, 6, 6)
        assert (~mask[0, 0]).int().tolist() == ALLOWED_ROW0
        assert (~mask[1, 0]).int().tolist() == CAUSAL
    else:
        assert mask is None  # plain causal


@pytest.mark.parametrize("reset_position_ids,reset_attention_mask,eod_mask_loss", FLAGS)
def test_matches_megatron_on_random_batches(reset_position_ids, reset_attention_mask, eod_mask_loss):
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 4, (3, 17), generator=generator)  # many eods (id 0)
    data[2] = 1  # and a row without any
    mask, loss, positions = get_ltor_masks_and_position_ids(data, 0, reset_position_ids, reset_attention_mask,
                                                            eod_mask_loss)
    ref_mask, ref_loss, ref_positions = megatron_reference(data, 0, reset_position_ids, reset_attention_mask,
                                                           eod_mask_loss)
    assert torch.equal(positions, ref_positions) and torch.equal(loss, ref_loss)
    if reset_attention_mask:
        assert mask.shape == (3, 17) and torch.equal(dense_document_mask(mask), ref_mask)
    else:
        assert mask is None and torch.equal(ref_mask[0, 0], ~torch.ones(17, 17, dtype=torch.bool).tril())


def test_get_batch_single_process():
    batch = {"text": torch.tensor([[5, 0, 6, 7, 0, 8, 9]])}
    tokens, labels, loss, mask, positions = get_batch(iter([batch]), DataConfig(eod_mask_loss=True,
                                                                                reset_position_ids=True), EOD)
    assert tokens.tolist() == [[5, 0, 6, 7, 0, 8]] and labels.tolist() == [[0, 6, 7, 0, 8, 9]]
    assert loss.tolist() == [EOD_LOSS[0]] and positions.tolist() == [RESET_POSITIONS[0]] and mask is None
    with pytest.raises(ValueError, match="iterator"):
        get_batch(None, DataConfig(), EOD)
    fixed = get_batch(iter([batch]), DataConfig(), EOD, shape=(1, 7))
    assert torch.equal(fixed[0], tokens)
    with pytest.raises(ValueError, match=r"batch of shape \(1, 7\), expected \(2, 7\)"):
        get_batch(iter([batch]), DataConfig(), EOD, shape=(2, 7))


def _all_batches(sampler):
    return [batch for batch in sampler]


def test_sampler_slices_and_drops_last():
    ranks = [_all_batches(MegatronPretrainingSampler(23, 0, 2, r, 3)) for r in range(3)]
    assert ranks[0][:2] == [[0, 1], [6, 7]] and ranks[2][:2] == [[4, 5], [10, 11]]
    assert all(len(batches) == 3 for batches in ranks)  # 18 of 23 used; the partial global batch dropped
    assert sorted(i for batches in ranks for b in batches for i in b) == list(range(18))
    assert len(MegatronPretrainingSampler(23, 0, 2, 0, 3)) == 3


@pytest.mark.parametrize("stop_after", [1, 2, 5])
def test_sampler_resumes_exactly(stop_after):
    full = [_all_batches(MegatronPretrainingSampler(40, 0, 3, r, 2)) for r in range(2)]
    consumed = stop_after * 3 * 2
    resumed = [_all_batches(MegatronPretrainingSampler(40, consumed, 3, r, 2)) for r in range(2)]
    for rank in range(2):
        assert resumed[rank] == full[rank][stop_after:]


def test_sampler_errors():
    with pytest.raises(DataError, match="consumed samples 10"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(DataError, match="geometry"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_resume_gives_the_same_tensors(num_workers):
    dataset = MockGPTDataset(30, 8, 50, seed=1)
    full = list(build_pretraining_data_loader(dataset, 0, 2, 1, 2, num_workers))
    resumed = list(build_pretraining_data_loader(dataset, 8, 2, 1, 2, num_workers))
    assert len(full) == 7 and len(resumed) == 5
    for a, b in zip(full[2:], resumed):
        assert torch.equal(a["text"], b["text"]) and a["text"].shape == (2, 9) and a["text"].dtype == torch.int64
    assert torch.equal(full[0]["text"][0], torch.from_numpy(dataset[2]["text"]))
    assert build_pretraining_data_loader(None, 0, 2, 0, 1, 0) is None
    assert not build_pretraining_data_loader(dataset, 0, 2, 0, 1, 0, pin_memory=True).pin_memory or \
        torch.cuda.is_available()
