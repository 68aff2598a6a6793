"""``MockGPTDataset``: random tokens in the shape of a ``GPTDataset`` (``--mock-data``, benchmarks)."""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from domino.data.errors import DataError


class MockGPTDataset(torch.utils.data.Dataset):
    """``num_samples`` items ``{"text": int64 array of seq_length + 1}`` of uniform ids in ``[0, vocab_size)``.

    Item ``i`` depends only on ``(seed, i)``, so every rank and every epoch sees the same data.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234) -> None:
        if num_samples < 0 or seq_length < 1 or vocab_size < 1:
            raise DataError(f"MockGPTDataset needs num_samples >= 0, seq_length >= 1, vocab_size >= 1; got "
                            f"{num_samples}, {seq_length}, {vocab_size}")
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} outside [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, int(idx)])
        return {"text": rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64)}
