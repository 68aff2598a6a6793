"""The Domino layer stack: the same transformer layers, run on batch chunks so communication overlaps.

The micro-batch is split along the batch dimension into N chunks. Each chunk runs the layers as a
sequence of six steps per layer (the names follow the reference schedule in the project notes)::

    A  QKV (column-parallel) + attention          D  fc1 (column-parallel)
    B  output projection; launch its all-reduce   E  GeLU (or SwiGLU) + fc2; launch its all-reduce
    C  wait; residual add; LN2 (+ grad guard)     F  wait; residual add; next LN1 (+ grad guard) or final LN

and the chunks advance as a wavefront: chunk ``c`` runs ``c`` steps behind chunk 0, and at every tick each
chunk does one step, chunk 0 first. For N=2 this is exactly the reference order (A0 F1 B0 A1 C0 B1 D0 C1
E0 D1 F0 E1 per layer): every all-reduce launched by one chunk is hidden behind a step of each other chunk
before it is waited on. Every rank runs the same Python, so collectives are issued (and waited) in the same
order on all ranks.

Backward: the forward all-reduces are identities for autograd. The LayerNorm outputs get their gradient
guard (step C/F) one tick before the column-parallel linear consumes them (step D/A); autograd runs nodes
in reverse creation order, so the other chunks' steps created in between run in backward between the
linear's asynchronous input-gradient all-reduce and the guard's wait (:mod:`domino.model.domino_ops`).
"""

from __future__ import annotations

import itertools
from typing import Callable, Generator, List, Optional, Sequence, Tuple

import torch

from domino.model.domino_ops import (
    ChunkedGradSlots, GradGatherSlot, GradReduceScatterSlot, guard_input_grad, wait_for_input_grad,
)
from domino.model.rotary import RotaryTables
from domino.model.transformer import TransformerLayer, bias_dropout_add
from domino.parallel.collectives import all_reduce_async, comm_site
from domino.parallel.random import tp_region_rng
from domino.parallel.recompute import replay, run_recorded
from domino.parallel.sequence_async import gather_from_sequence_region_async, reduce_scatter_to_sequence_async


class _Pending:
    """A chunk's row-parallel partial sum whose all-reduce is in flight, plus what to add once it lands."""

    __slots__ = ("partial", "bias", "handle")

    def __init__(self, partial: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.partial = partial
        self.bias = bias
        # Async launch: waited in finish(), one step of every other chunk later.
        self.handle = all_reduce_async(partial)

    def finish(self, residual: torch.Tensor, layer: TransformerLayer) -> torch.Tensor:
        self.handle.wait()  # wait for the all-reduce launched in __init__: its sum is read right here
        return bias_dropout_add(self.partial, self.bias, residual, layer.hidden_dropout, layer.training)


class _PendingScatter:
    """Sequence parallelism's counterpart of :class:`_Pending`: a reduce-scatter along the sequence in flight.

    The residual stream is this rank's sequence slice, so the bias, the dropout (on the TP stream: each rank's
    slice needs its own mask, as Megatron forks the tracker around sequence-parallel regions) and the residual
    add run on ``[b, s/tp, h]``.
    """

    __slots__ = ("bias", "handle", "result")

    def __init__(self, partial: torch.Tensor, bias: Optional[torch.Tensor], site: Optional[str] = None) -> None:
        self.bias = bias
        grad_slot = GradGatherSlot(site)
        # In backward, the gradient's all-gather is launched by the reduce-scatter's node (made in finish()) and
        # waited for here, on the partial sum: the other chunks' backward made in between runs meanwhile.
        partial = wait_for_input_grad(partial, grad_slot)
        # Async launch: waited in finish(), one step of every other chunk later.
        self.handle, self.result = reduce_scatter_to_sequence_async(partial, grad_slot)

    def finish(self, residual: torch.Tensor, layer: TransformerLayer) -> torch.Tensor:
        self.handle.wait()  # wait for the reduce-scatter launched in __init__: its slice is read right here
        with tp_region_rng(layer.hidden_dropout > 0 and layer.training):
            return bias_dropout_add(self.result(), self.bias, residual, layer.hidden_dropout, layer.training)


class _PendingInput:
    """A chunk's rows of the stack's input while their all-reduce is in flight (the word embeddings)."""

    __slots__ = ("partial", "complete", "rows", "handle")

    def __init__(self, partial: torch.Tensor, complete: Callable, rows: slice, site: str) -> None:
        self.partial, self.complete, self.rows = partial, complete, rows
        with comm_site(site):
            # Async launch: waited in finish(), when the chunk starts (chunk c after c ticks of the others).
            self.handle = all_reduce_async(partial)

    def finish(self) -> torch.Tensor:
        self.handle.wait()  # wait for the all-reduce launched in __init__: the rows are read right here
        return self.complete(self.partial, self.rows)


def _split_mask(mask: Optional[torch.Tensor], sizes: List[int]) -> List[Optional[torch.Tensor]]:
    if mask is None or mask.shape[0] == 1:
        return [mask] * len(sizes)
    return list(torch.split(mask, sizes, dim=0))


class DominoLayerStack:
    """Runs ``layers`` (and the final LayerNorm) on the overlapped N-chunk schedule.

    Not an ``nn.Module``: it owns no parameters, it only drives the model's own layers, so parameter names
    and checkpoints are the same with and without Domino.

    Args:
        layers: the model's transformer layers (at least one).
        chunks: number of batch chunks (>= 1; 1 runs the asynchronous code path with nothing to overlap).
    """

    def __init__(self, layers: Sequence[TransformerLayer], chunks: int) -> None:
        if chunks < 1:
            raise ValueError(f"--domino-chunks must be >= 1, got {chunks}")
        if len(layers) == 0:
            raise ValueError("the Domino schedule needs at least one transformer layer")
        self.layers = layers
        self.chunks = chunks
        #: ``(start, end, checkpointed)`` layer groups; full activation recompute sets it (domino.model.recompute).
        self.units: List[Tuple[int, int, bool]] = [(0, len(layers), False)]
        #: Sequence parallelism: the residual stream is this rank's sequence slice (domino.model.sequence_parallel).
        self.sequence_parallel = False

    def _column_input(self, x: torch.Tensor, site: str) -> Callable[[], tuple]:
        """A norm's output made ready for a column-parallel linear: ``ready``, whose call, when the linear runs,
        returns ``(input, gradient slot)``.

        Plain TP: the output with its gradient guard (the linear launches the input-gradient all-reduce into the
        slot, created now so that its wait runs after the other chunks' backward). Sequence parallelism: the
        output's all-gather, launched now and waited for in ``ready()`` (one step of every other chunk later), with
        its reduce-scatter slot: the linear launches the input gradient's reduce-scatter into it (the gather's
        backward waits for it), and saves the slot's slice of its input instead of the gathered sequence
        (Megatron's choice: the norm outputs cost ``sbh / t``; ``domino.parallel.linear_ops.saved_input``).
        """
        if self.sequence_parallel:
            slot = GradReduceScatterSlot(x, site)
            # Async launch: ready() waits for it right before the linear reads it, after the other chunks' step.
            handle, gathered = gather_from_sequence_region_async(x, slot)

            def ready():
                handle.wait()  # wait for the all-gather launched at the norm: the linear reads it now
                return gathered, slot

            return ready
        guarded = guard_input_grad(x, site)
        return lambda: guarded

    def _reduce(self, partial: torch.Tensor, bias: Optional[torch.Tensor], site: str):
        """Launches the reduction of a row-parallel partial sum: an all-reduce, or (SP) a reduce-scatter."""
        with comm_site(site):
            if self.sequence_parallel:
                # "fwd attention, <where>" -> "bwd attention output grad, <where>": the backward all-gather's label.
                kind, where = site.split(", ", 1)
                return _PendingScatter(partial, bias, f"{kind.replace('fwd', 'bwd', 1)} output grad, {where}")
            return _Pending(partial, bias)

    def _site(self, index: int, chunk: int) -> str:
        """``"<first|mid|last> layer, chunk c"``: the label of a layer's waits in the comm-wait breakdown."""
        where = "first" if index == 0 else "last" if index == len(self.layers) - 1 else "mid"
        return f"{where} layer, chunk {chunk}"

    def _layer_steps(self, layer: TransformerLayer, h: torch.Tensor, mask: Optional[torch.Tensor],
                     rotary: Optional[RotaryTables], site: str) -> Generator[None, None, torch.Tensor]:
        """One chunk's steps through one layer (LN1 + guard, then A-F); yields between steps, returns the output.

        F of layer i and LN1 of layer i+1 share a tick (no yield between them), as in the reference order. With
        sequence parallelism ``h`` is this rank's sequence slice: the norms run on the slice, their outputs are
        all-gathered, and the row-parallel sums are reduce-scattered (async, overlapped like the all-reduces).
        """
        attention, mlp = layer.attention, layer.mlp
        ready = self._column_input(layer.input_layernorm(h), f"bwd attention input grad, {site}")
        yield
        ctx = attention.context(*attention.qkv(*ready()), mask, rotary=rotary)  # A
        del ready  # with SP it holds the gathered sequence: the linear kept only its slice
        yield
        pending = self._reduce(attention.dense.partial(ctx), attention.dense.bias, f"fwd attention, {site}")  # B
        yield
        h = pending.finish(h, layer)  # C
        ready = self._column_input(layer.post_attention_layernorm(h), f"bwd mlp input grad, {site}")
        yield
        inner = mlp.inner(*ready())  # D
        del ready
        yield
        pending = self._reduce(mlp.partial(inner), mlp.dense_4h_to_h.bias, f"fwd mlp, {site}")  # E
        yield
        return pending.finish(h, layer)  # F

    def _group_steps(self, start: int, end: int, h: torch.Tensor, mask: Optional[torch.Tensor],
                     rotary: Optional[RotaryTables], chunk: int) -> Generator[None, None, torch.Tensor]:
        for index in range(start, end):
            h = yield from self._layer_steps(self.layers[index], h, mask, rotary, self._site(index, chunk))
        return h

    def _chunk_steps(self, h: torch.Tensor, mask: Optional[torch.Tensor], rotary: Optional[RotaryTables],
                     final_layernorm: Optional[torch.nn.Module], chunk: int) -> Generator[None, None, torch.Tensor]:
        """One chunk's steps through every layer; yields between steps, returns the chunk's output."""
        if isinstance(h, _PendingInput):
            h = h.finish()
        recompute = torch.is_grad_enabled()
        for start, end, checkpointed in self.units:
            if checkpointed and recompute:
                # Full recompute: run the group without keeping activations (same steps, same yields) and
                # record the RNG state before each step, so backward replays every dropout mask exactly.
                record: List = []
                out = yield from run_recorded(self._group_steps(start, end, h.detach(), mask, rotary, chunk), record)
                h = replay(h, out,
                           lambda x, start=start, end=end: self._group_steps(start, end, x, mask, rotary, chunk),
                           record)
            else:
                h = yield from self._group_steps(start, end, h, mask, rotary, chunk)
        return final_layernorm(h) if final_layernorm is not None else h

    def __call__(self, hidden: torch.Tensor, attend_mask: Optional[torch.Tensor],
                 final_layernorm: Optional[torch.nn.Module], rotary: Optional[RotaryTables] = None,
                 guard_output: bool = False, finish_input: Optional[Callable] = None):
        """``[b, s, h]`` embeddings -> ``[b, s, h]`` (after the final norm when one is given).

        ``attend_mask`` (True = may attend, or None for causal) is split into per-chunk views, not copied;
        ``rotary``: the rotary tables of the positions (rope models), split along the batch like the mask.
        ``guard_output``: also guard each chunk's output as it is produced and return ``(output, slots)``, the
        :class:`ChunkedGradSlots` to hand to the column-parallel linear that consumes the output (the output
        layer): its input gradient is then all-reduced chunk by chunk, each waited on by its own chunk.
        ``finish_input``: ``hidden`` is a partial sum still to be all-reduced over the TP ranks (the word
        embeddings); each chunk's all-reduce is launched at once, and each chunk waits for its own as it starts,
        then calls ``finish_input(reduced_rows, rows)`` (a slice of the batch) for its input. Chunk 0 waits
        right away; the others' all-reduces run behind the chunks started before them.
        """
        b = hidden.shape[0]
        if b < self.chunks:
            raise ValueError(f"micro-batch size {b} is smaller than --domino-chunks {self.chunks}")
        sizes = [len(idx) for idx in torch.arange(b).tensor_split(self.chunks)]
        masks = _split_mask(attend_mask, sizes)
        tables = rotary.split(sizes) if rotary is not None else [None] * self.chunks
        inputs = list(torch.split(hidden, sizes, dim=0))
        if finish_input is not None:
            starts = [0, *itertools.accumulate(sizes)]
            # narrow, not split: a single view may be reduced in place (and a late handle may write into it).
            inputs = [_PendingInput(hidden.narrow(0, starts[c], sizes[c]), finish_input,
                                    slice(starts[c], starts[c + 1]), f"fwd embedding, chunk {c}")
                      for c in range(self.chunks)]
        programs = [self._chunk_steps(h, m, r, final_layernorm, c)
                    for c, (h, m, r) in enumerate(zip(inputs, masks, tables))]
        outputs: List[Optional[torch.Tensor]] = [None] * self.chunks
        slots: List = [None] * self.chunks
        running = self.chunks
        tick = 0
        while running:
            for c, program in enumerate(programs):
                if tick < c or outputs[c] is not None:  # chunk c starts c ticks late (the wavefront)
                    continue
                try:
                    next(program)
                except StopIteration as done:
                    outputs[c] = done.value
                    if guard_output:  # created as the chunk finishes: the other chunks' tail runs in between
                        outputs[c], slots[c] = guard_input_grad(outputs[c], f"bwd output layer input grad, chunk {c}")
                    running -= 1
            tick += 1
        out = torch.cat(outputs, dim=0)
        return (out, ChunkedGradSlots(slots, sizes)) if guard_output else out
