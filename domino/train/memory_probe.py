"""Live tensor bytes of a block of torch code on any device: a measurement for memory estimates and benchmarks.

``torch.cuda.max_memory_allocated`` exists only on GPUs, so this counter works one level up: a
``TorchDispatchMode`` sees every tensor an operator returns, counts the bytes of each new storage once, and a
weak-reference finaliser on the storage subtracts them when the storage is freed (torch keeps one Python object
per storage alive as long as the storage, since torch 2.1, which makes the finaliser fire at the real free).
Operator workspaces never returned to Python (a GEMM's scratch) are not seen; tensors created before the block
are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from domino.model import GPTModel
from domino.model.recompute import apply_activation_recompute
from domino.overlap.schedule import apply_domino
from domino.parallel.context_split import split_batch
from domino.overlap.sequence_parallel import apply_sequence_parallel
from domino.pipeline.gradients import sync_tied_embeddings
from domino.pipeline.schedule import StageSchedule
from domino.pipeline.stages import split_model
from domino.runtime.mesh import ParallelMesh
from domino.train.parallelize import CONTEXT_PARALLEL_ATTENTION


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages created inside the ``with`` block that are still alive.

    Attributes:
        live: bytes alive now.
        peak: the most bytes alive at once since the start (or the last :meth:`reset_peak`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:  # a view or an in-place result: no new memory
            return
        size = storage.nbytes()
        self._seen[storage] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size

    def reset_peak(self) -> None:
        """Starts a new peak from the bytes alive now."""
        self.peak = self.live


def measure_training_memory(model_config, vocab_size: int, batch: int, steps: int = 2, seed: int = 0,
                            recompute=None, domino_chunks: int = 1, sequence_parallel: bool = False,
                            mesh: ParallelMesh = ParallelMesh.single(), cp_comm_type: str = "p2p"):
    """Tensor memory of training a fresh ``GPTModel`` with AdamW (fp32) on this process (one rank of ``mesh.tp``
    and of ``mesh.cp``, which trains on its ``seq / CP`` tokens of every sample), measured with
    :class:`LiveTensorBytes`.

    ``recompute`` is a :class:`domino.model.recompute.RecomputePlan` (None: no recompute); ``cp_comm_type`` picks
    the context-parallel attention (p2p: the ring, a2a: the all-to-all). The peak starts after the model is built
    (initialisation draws each sharded weight in full before keeping its slice).

    Returns:
        ``(forward, peak)`` in bytes: what the first forward added (activations, logits, saved copies), and the
        peak over ``steps`` full steps (weights, optimizer state, activations, gradients).
    """
    torch.manual_seed(seed)
    tokens, labels = (torch.randint(0, vocab_size, (batch, model_config.seq_length)) for _ in range(2))
    local = split_batch(dict(tokens=tokens, labels=labels, position_ids=None), mesh.cp)
    with LiveTensorBytes() as mode:
        model = GPTModel(model_config, vocab_size, tp=mesh.tp, cp=mesh.cp)
        for layer in model.layers:
            layer.attention.context_parallel_attention = CONTEXT_PARALLEL_ATTENTION[cp_comm_type]
        if sequence_parallel:
            apply_sequence_parallel(model)
        model = apply_activation_recompute(apply_domino(model, domino_chunks), recompute)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mode.reset_peak()
        forward = None
        for _ in range(steps):
            before = mode.live
            loss = model(local["tokens"], local["position_ids"], labels=local["labels"])
            forward = forward if forward is not None else mode.live - before
            loss.mean().backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return forward, mode.peak


def measure_pipeline_training_memory(model_config, vocab_size: int, micro_batch_size: int, num_microbatches: int,
                                     steps: int = 2, seed: int = 0, mesh: ParallelMesh = ParallelMesh.single()
                                     ) -> int:
    """The peak tensor bytes of this rank's pipeline stage over ``steps`` AdamW steps (fp32) of the 1F1B schedule
    (:class:`domino.pipeline.schedule.StageSchedule`), measured with :class:`LiveTensorBytes` from after the model
    is cut to ``mesh``'s stage (it is built whole first)."""
    torch.manual_seed(seed)
    batch = micro_batch_size * num_microbatches
    tokens, labels = (torch.randint(0, vocab_size, (batch, model_config.seq_length)) for _ in range(2))
    loss_mask = torch.ones(batch, model_config.seq_length)
    with LiveTensorBytes() as mode:
        model = split_model(GPTModel(model_config, vocab_size, tp=mesh.tp), mesh.pp.rank, mesh.pp.size)
        pipeline = StageSchedule(model, mesh.pp, num_microbatches=num_microbatches, micro_batch_size=micro_batch_size,
                                 seq_length=model_config.seq_length, hidden_size=model_config.hidden_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mode.reset_peak()
        for _ in range(steps):
            pipeline.train_step(tokens, labels, loss_mask)
            sync_tied_embeddings(model, mesh)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return mode.peak
