"""Data pipeline: tokenizers, ``domino preprocess``, Megatron ``.bin``/``.idx`` datasets, GPT sample indices,
blending, batches and loaders. See ``docs/data.md``.

Submodules are imported on first use (``domino.data.build_tokenizer`` works), so ``domino preprocess``
starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataError": "domino.data.errors",
    "Tokenizer": "domino.data.tokenizer",
    "build_tokenizer": "domino.data.tokenizer",
    "train_tokenizer": "domino.data.tokenizer_training",
    "IndexedDataset": "domino.data.indexed_dataset",
    "IndexedDatasetWriter": "domino.data.indexed_dataset",
    "PreprocessResult": "domino.data.preprocess",
    "preprocess": "domino.data.preprocess",
    "list_builtin_corpora": "domino.data.builtin_corpora",
    "GPTDataset": "domino.data.gpt_dataset",
    "BlendableDataset": "domino.data.blending",
    "MockGPTDataset": "domino.data.mock",
    "build_train_valid_test_datasets": "domino.data.dataset_builder",
    "get_batch": "domino.data.batch",
    "get_ltor_masks_and_position_ids": "domino.data.batch",
    "build_pretraining_data_loader": "domino.data.loader",
    "MegatronPretrainingSampler": "domino.data.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'domino.data' has no attribute {name!r}")
