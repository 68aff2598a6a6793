"""The Domino schedule: the same transformer layers, run on batch chunks so communication overlaps computation.

The micro-batch is split along the batch dimension (dimension 1 of the ``[s, b, h]`` activations, as
DeepSpeed-Domino splits it: ``torch.tensor_split(encoder_input, 2, dim=1)`` in microsoft/DeepSpeedExamples
``training/DeepSpeed-Domino/domino/language_model.py``, 7114c08e) into N chunks; each chunk runs the step program of
:mod:`domino.overlap.steps` (six steps A-F per layer), and the chunks advance as a wavefront: chunk ``c`` runs
``c`` steps behind chunk 0, and at every tick each chunk does one step, chunk 0 first. For N=2 this is exactly
the reference order (A0 F1 B0 A1 C0 B1 D0 C1 E0 D1 F0 E1 per layer): every all-reduce launched by one chunk is
hidden behind a step of each other chunk before it is waited on. Every rank runs the same Python, so collectives
are issued (and waited) in the same order on all ranks.

Backward: the forward all-reduces are identities for autograd. The LayerNorm outputs get their gradient
guard (step C/F) one tick before the column-parallel linear consumes them (step D/A); autograd runs nodes
in reverse creation order, so the other chunks' steps created in between run in backward between the
linear's asynchronous input-gradient all-reduce and the guard's wait (:mod:`domino.overlap.slots`).

Applied to a built model from outside, as torchtitan applies its parallelisms (``apply_tp``, ``apply_fsdp`` in
``torchtitan/models/llama3/infra/parallelize.py``): :func:`apply_domino` replaces the model's stack, keeping the
replaced one for generation and for batches smaller than the chunk count.
"""

from __future__ import annotations

import itertools
from typing import Callable, List, Optional

import torch

from domino.model.kv_cache import KVCache
from domino.model.rotary import RotaryTables
from domino.model.stack import LayerStack, StackOutput
from domino.overlap.slots import guard_input_grad
from domino.overlap.steps import StepStack
from domino.parallel.collectives import MeshGroup, all_reduce_async, comm_site


class _PendingInput:
    """A chunk's word embeddings while their all-reduce is in flight."""

    __slots__ = ("partial", "complete", "rows", "handle")

    def __init__(self, partial: torch.Tensor, complete: Callable, rows: slice, tp: MeshGroup, site: str) -> None:
        self.partial, self.complete, self.rows = partial, complete, rows
        with comm_site(site, tp):
            # Async launch: waited in finish(), when the chunk starts (chunk c after c ticks of the others).
            self.handle = all_reduce_async(partial, tp)

    def finish(self) -> torch.Tensor:
        self.handle.wait()  # wait for the all-reduce launched in __init__: the rows are read right here
        return self.complete(self.partial, self.rows)


def _split_mask(mask: Optional[torch.Tensor], sizes: List[int]) -> List[Optional[torch.Tensor]]:
    if mask is None or mask.shape[0] == 1:
        return [mask] * len(sizes)
    return list(torch.split(mask, sizes, dim=0))


class DominoStack(StepStack):
    """Runs the model's layers (and the final norm) on the overlapped N-chunk schedule.

    Args:
        model: the ``GPTModel`` whose layers it runs (at least one).
        chunks: number of batch chunks (>= 1; 1 runs the asynchronous code path with nothing to overlap).
        fallback: the stack it replaces: it runs generation and batches smaller than ``chunks``.
        sequence_parallel: the residual stream is this rank's sequence slice (reduce-scatters, all-gathers).
    """

    def __init__(self, model: torch.nn.Module, chunks: int, fallback: LayerStack,
                 sequence_parallel: bool = False) -> None:
        if chunks < 1:
            raise ValueError(f"--domino-chunks must be >= 1, got {chunks}")
        super().__init__(model, fallback, sequence_parallel)
        self.chunks = chunks

    def select(self, batch: int, kv_cache: Optional[KVCache]) -> LayerStack:
        """This stack for training and evaluation batches it can split; else its fallback's choice."""
        if kv_cache is None and batch >= self.chunks:
            return self
        return self.fallback.select(batch, kv_cache)

    def _embeds_per_chunk(self) -> bool:
        """Whether the word embeddings' all-reduce runs per chunk, inside the stack: each chunk waits for its own as
        it starts. Not with embedding dropout in training, whose mask is drawn for the whole batch (as without
        Domino), nor with sequence parallelism (the stack's input is already a sequence slice)."""
        m = self.model
        return m.pre_process and not self.sequence_parallel and not (m.embedding.dropout > 0 and m.training)

    def _sizes(self, batch: int) -> List[int]:
        """The chunks' batch sizes (``tensor_split``'s: the first ones one larger when ``batch`` does not divide)."""
        if batch < self.chunks:
            raise ValueError(f"micro-batch size {batch} is smaller than --domino-chunks {self.chunks}")
        return [len(idx) for idx in torch.arange(batch).tensor_split(self.chunks)]

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings, or this rank's unreduced lookup when the stack reduces it per chunk.

        That lookup is one ``[tokens, h]`` tensor whose rows are chunk 0's ``[s, b_0]``, then chunk 1's, ...: one
        lookup (one gradient for the table) in which every chunk's ``[s, b_c, h]`` is a contiguous block, so its
        all-reduce runs in place (a batch slice of ``[s, b, h]`` would be strided).
        """
        if not self._embeds_per_chunk():
            return super().embed(tokens, position_ids)
        ids = torch.cat([part.t().reshape(-1) for part in torch.split(tokens, self._sizes(tokens.shape[0]))])
        return self.model.embedding.word_embeddings.partial(ids)

    def _starts(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                sizes: List[int]) -> List[Callable[[], torch.Tensor]]:
        """Per chunk, what returns its ``[s, b_c, h]`` input when the chunk starts (a batch slice, views)."""
        if not self._embeds_per_chunk():
            return [lambda h=h: h for h in torch.split(hidden, sizes, dim=1)]
        embedding, seq = self.model.embedding, position_ids.shape[-1]
        offsets = [0, *itertools.accumulate(sizes)]

        def complete(words: torch.Tensor, rows: slice) -> torch.Tensor:
            return embedding.finish(words, position_ids[rows] if position_ids.shape[0] > 1 else position_ids)

        # Each chunk's all-reduce is launched at once; chunk c waits for its own when it starts. narrow, not split:
        # a single view may be reduced in place (and a late handle may write into it).
        return [_PendingInput(hidden.narrow(0, seq * offsets[c], seq * sizes[c]).view(seq, sizes[c], -1), complete,
                              slice(offsets[c], offsets[c + 1]), self.tp, f"fwd embedding, chunk {c}").finish
                for c in range(self.chunks)]

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor, attend_mask: Optional[torch.Tensor],
                 rotary: Optional[RotaryTables], kv_cache: Optional[KVCache] = None) -> StackOutput:
        """What :meth:`embed` returned (``[s, b, h]`` embeddings, or the chunk-ordered lookup) -> the final norm's
        ``[s, b, h]`` output (``kv_cache`` must be None: see :meth:`select`).

        ``attend_mask`` (True = may attend, or None for causal) is split into per-chunk views, not copied;
        ``rotary``: the rotary tables of the positions (rope models), split along the batch like the mask.
        With an output layer (and without sequence parallelism) the joined output is guarded, so the output
        layer's backward launches its input gradient's all-reduce before its weight-gradient GEMM and the guard
        waits for it (one all-reduce: a batch chunk of the ``[s, b, h]`` gradient is strided). When :meth:`embed`
        returned the unreduced lookup, each chunk's all-reduce of it is launched at once and each chunk waits for
        its own as it starts (chunk 0 right away, the others behind the chunks started before them), then adds its
        positions and dropout.
        """
        lookup = self._embeds_per_chunk()  # hidden: [b s, h] lookups (position ids: [b or 1, s]), else [s, b, h]
        sizes = self._sizes(hidden.shape[0] // position_ids.shape[-1] if lookup else hidden.shape[1])
        masks = _split_mask(attend_mask, sizes)
        tables = rotary.split(sizes) if rotary is not None else [None] * self.chunks
        starts = self._starts(hidden, position_ids, sizes)
        programs = [self.chunk_steps(start, m, r, c) for c, (start, m, r) in enumerate(zip(starts, masks, tables))]
        outputs: List[Optional[torch.Tensor]] = [None] * self.chunks
        running, tick = self.chunks, 0
        while running:
            for c, program in enumerate(programs):
                if tick < c or outputs[c] is not None:  # chunk c starts c ticks late (the wavefront)
                    continue
                try:
                    next(program)
                except StopIteration as done:
                    outputs[c] = done.value
                    running -= 1
            tick += 1
        out = torch.cat(outputs, dim=1)
        if self.model.post_process and not self.sequence_parallel:
            out, slot = guard_input_grad(out, self.tp, "bwd output layer input grad")
            return self.output(out, slot)
        return self.output(out)


def apply_domino(model: torch.nn.Module, chunks: int) -> torch.nn.Module:
    """Makes ``model`` (a ``GPTModel``) run its training and evaluation forward on the Domino schedule with ``chunks``
    batch chunks; returns it. ``chunks == 1`` leaves it unchanged (the synchronous stack is one chunk).

    Apply it after :func:`domino.overlap.sequence_parallel.apply_sequence_parallel` (whose stack it takes over:
    the chunks then reduce-scatter and all-gather) and before or after
    :func:`domino.model.recompute.apply_activation_recompute` (the recompute groups carry over).

    Raises:
        ValueError: ``chunks`` < 1, or the model has no transformer layer.
    """
    if chunks < 1:
        raise ValueError(f"--domino-chunks must be >= 1, got {chunks}")
    if chunks == 1:
        return model
    current = model.stack
    # With sequence parallelism the chunks take over its stack; batches they cannot split run the plain stack.
    fallback = current.fallback if current.sequence_parallel else current
    stack = DominoStack(model, chunks, fallback, sequence_parallel=current.sequence_parallel)
    stack.units = list(current.units)
    model.stack = stack
    return model
