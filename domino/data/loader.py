"""Data loaders for pretraining: Megatron's ``MegatronPretrainingSampler`` over a torch ``DataLoader``.

The sampler walks the dataset in order from ``consumed_samples`` (so a resumed run continues exactly
where the checkpointed one stopped), cuts it into global batches of ``micro_batch_size * dp_size`` and
gives each data-parallel rank its slice; an incomplete last global batch is dropped. Worker processes
prefetch batches so training does not wait on reads, and batches are pinned only when CUDA exists.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch

from domino.child_signals import ShieldedWorkerInit, stop_signals_held
from domino.data.errors import DataError


class MegatronPretrainingSampler:
    """Batch sampler: indices ``[consumed_samples, total_samples)`` in order, this rank's slice of each global batch.

    Args:
        total_samples: length of the dataset.
        consumed_samples: samples already trained on (by all ranks together).
        micro_batch_size: samples per rank per step.
        data_parallel_rank: this rank's position among the data-parallel ranks.
        data_parallel_size: number of data-parallel ranks.
        drop_last: drop an incomplete last global batch (Megatron's default, True).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise DataError(f"no samples to load (dataset length {total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise DataError(f"consumed samples {consumed_samples} must be in [0, {total_samples}) "
                            f"(the dataset is exhausted or the checkpoint is from a longer run)")
        if micro_batch_size <= 0 or data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise DataError(f"bad sampler geometry: micro_batch_size={micro_batch_size}, "
                            f"data_parallel_rank={data_parallel_rank}, data_parallel_size={data_parallel_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Number of micro-batches this sampler yields."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.global_batch)
        partial = rest > self.data_parallel_rank * self.micro_batch_size and not self.drop_last
        return full + int(partial)

    def __iter__(self) -> Iterator[List[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        batch_start = self.consumed_samples
        while batch_start + self.global_batch <= self.total_samples:
            first = batch_start + start
            yield list(range(first, first + self.micro_batch_size))
            batch_start += self.global_batch
        if not self.drop_last and batch_start < self.total_samples:
            last = list(range(batch_start, self.total_samples))[start:start + self.micro_batch_size]
            if last:
                yield last


class StopSignalSafeLoader(torch.utils.data.DataLoader):
    """A ``DataLoader`` whose workers ignore SIGTERM and SIGINT: the rank that reads from it decides what a stop
    signal means (save at the next step), and a worker killed by it would end the rank first
    (:mod:`domino.child_signals`)."""

    def __iter__(self):
        with stop_signals_held():  # the workers start in here; a stop signal meanwhile waits for the rank
            return super().__iter__()


def build_pretraining_data_loader(dataset: Optional[torch.utils.data.Dataset], consumed_samples: int,
                                  micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int, pin_memory: Optional[bool] = None
                                  ) -> Optional[torch.utils.data.DataLoader]:
    """A ``DataLoader`` yielding ``{"text": LongTensor[micro_batch_size, seq_length + 1]}`` for this rank.

    Args:
        dataset: a dataset (None gives None, as for an empty split).
        consumed_samples: samples consumed before (from the checkpoint); loading resumes right after them.
        micro_batch_size: samples per step on this rank.
        data_parallel_rank: this rank's data-parallel index.
        data_parallel_size: number of data-parallel ranks.
        num_workers: loader worker processes (0 reads in the training process); each keeps two
            batches prefetched.
        pin_memory: pin host memory for fast copies (default: only when CUDA is available).
    """
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
                                         data_parallel_size)
    pin = torch.cuda.is_available() if pin_memory is None else (pin_memory and torch.cuda.is_available())
    extra = {"prefetch_factor": 2, "persistent_workers": True} if num_workers > 0 else {}
    # A private generator: starting an iterator draws a worker seed, and drawing it from the global RNG would
    # shift the dropout stream, so a resumed run would no longer repeat the uninterrupted one bit for bit.
    return StopSignalSafeLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin,
                                generator=torch.Generator().manual_seed(0), worker_init_fn=ShieldedWorkerInit(),
                                **extra)
