"""Two real gloo ranks (TP=2): rank 0 builds the index cache while rank 1 waits; get_batch broadcasts."""

import numpy as np
import torch

from data_helpers import write_dataset
from distributed_helpers import run_distributed
from domino.config import DataConfig


def _body(rank, world_size, prefix, cache_dir):
    from domino.data import gpt_dataset
    from domino.data.batch import get_batch
    from domino.data.dataset_builder import build_train_valid_test_datasets
    from domino.data.loader import build_pretraining_data_loader
    from domino.runtime import state

    mesh = state.initialize_model_parallel(2)
    builds = []
    original = gpt_dataset.build_indices
    gpt_dataset.build_indices = lambda *args: builds.append(1) or original(*args)
    train, _, _ = build_train_valid_test_datasets([prefix], "1", [24, 0, 0], 8, 5, True, data_cache_path=cache_dir)
    # TP rank 1 gets no iterator: the batch must come from rank 0
    loader = build_pretraining_data_loader(train, 4, 2, mesh.dp.rank, mesh.dp.size, 0)
    iterator = iter(loader) if mesh.tp.rank == 0 else None
    config = DataConfig(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    # The first batch's shape is broadcast; the second is announced as fixed, so only its tokens are sent.
    batches = [tuple(t.clone() for t in get_batch(iterator, config, 0, shape, mesh.tp)) for shape in (None, (2, 9))]
    return {"builds": len(builds), "batches": batches}


def test_rank0_builds_and_get_batch_broadcasts(tmp_path):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 99, size=int(n))) + [0] for n in rng.integers(1, 12, size=30)]
    prefix = write_dataset(str(tmp_path / "d"), docs)
    cache = str(tmp_path / "cache")
    results = run_distributed(_body, 2, prefix, cache)
    assert [r["builds"] for r in results] == [1, 0]

    # unsharded reference in this process, from the cache rank 0 wrote
    from domino.data.batch import get_batch
    from domino.data.dataset_builder import build_train_valid_test_datasets
    from domino.data.loader import build_pretraining_data_loader

    train, _, _ = build_train_valid_test_datasets([prefix], "1", [24, 0, 0], 8, 5, True, data_cache_path=cache)
    iterator = iter(build_pretraining_data_loader(train, 4, 2, 0, 1, 0))
    config = DataConfig(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    for step in range(2):
        expected = get_batch(iterator, config, 0)
        for rank in range(2):
            for got, want in zip(results[rank]["batches"][step], expected):
                assert torch.equal(got, want)
    assert (results[1]["batches"][0][0] == 0).any()  # the example exercises document boundaries
