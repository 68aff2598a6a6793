"""One batch chunk's way through the layers as a step program, and the asynchronous reducer its steps hand over to.

Each layer's steps A-F are the layer's own (:meth:`domino.model.transformer.TransformerLayer.steps`, the steps the
plain forward runs with synchronous reductions); :class:`StepStack` chains them through the layers and is their
:class:`~domino.model.transformer.Reducer`: it launches each row-parallel reduction at B and E and waits for it at
C and F, and guards (or, with sequence parallelism, all-gathers) the column-parallel inputs::

    A  QKV (column-parallel) + attention          D  fc1 (column-parallel)
    B  output projection; launch its reduction    E  GeLU (or SwiGLU) + fc2; launch its reduction
    C  wait; residual add; LN2 (+ grad guard)     F  wait; residual add; next LN1 (+ grad guard) or final LN

A step program is a generator that yields between steps and returns the chunk's output, so a driver decides
what runs between a launch and its wait: :class:`~domino.overlap.schedule.DominoStack` runs N programs as a
wavefront, :class:`~domino.overlap.sequence_parallel.SequenceParallelStack` runs one to its end.

The row-parallel reduction is an all-reduce (plain TP) or, with sequence parallelism, a reduce-scatter along the
sequence; the column-parallel input is the norm's output with its gradient guard, or its all-gather. Backward:
the forward reductions are identities for autograd; each column-parallel linear launches its input gradient's
reduction into its slot (:mod:`domino.overlap.slots`) and a no-op node created one tick earlier waits for it.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from domino.model.rotary import RotaryTables
from domino.model.stack import StackOutput, Unit, embed_tokens
from domino.model.transformer import Steps, TransformerLayer, bias_dropout_add, bias_dropout_add_norm
from domino.overlap.sequence_collectives import gather_from_sequence_region_async, reduce_scatter_to_sequence_async
from domino.overlap.slots import GradGatherSlot, GradReduceScatterSlot, guard_input_grad, wait_for_input_grad
from domino.parallel.collectives import (
    MeshGroup, all_reduce_async, comm_site, gather_from_sequence_region, scatter_to_sequence_region,
)
from domino.parallel.layers import Product, RowParallelLinear
from domino.parallel.random import tp_region_rng
from domino.parallel.recompute import replay, run_recorded


class _Pending:
    """A chunk's row-parallel partial sum whose all-reduce is in flight, plus what to add once it lands."""

    __slots__ = ("partial", "bias", "handle")

    def __init__(self, partial: torch.Tensor, bias: Optional[torch.Tensor], tp: MeshGroup) -> None:
        self.partial = partial
        self.bias = bias
        # Async launch: waited in finish(), one step of every other chunk later.
        self.handle = all_reduce_async(partial, tp)

    def finish(self, residual: torch.Tensor, layer: TransformerLayer) -> torch.Tensor:
        self.handle.wait()  # wait for the all-reduce launched in __init__: its sum is read right here
        return bias_dropout_add(self.partial, self.bias, residual, layer.hidden_dropout, layer.training,
                                layer.kernels)

    def finish_norm(self, residual: torch.Tensor, layer: TransformerLayer, norm: torch.nn.Module):
        """:meth:`finish` and ``norm`` of its result, as one island: ``(hidden, norm(hidden))``."""
        self.handle.wait()  # wait for the all-reduce launched in __init__: its sum is read right here
        return bias_dropout_add_norm(self.partial, self.bias, residual, layer.hidden_dropout, layer.training, norm,
                                     layer.kernels)


class _PendingScatter:
    """Sequence parallelism's counterpart of :class:`_Pending`: a reduce-scatter along the sequence in flight.

    The residual stream is this rank's sequence slice, so the bias, the dropout (on the TP stream: each rank's
    slice needs its own mask, as Megatron forks the tracker around sequence-parallel regions) and the residual
    add run on ``[s/tp, b, h]``.
    """

    __slots__ = ("bias", "handle", "result")

    def __init__(self, partial: torch.Tensor, bias: Optional[torch.Tensor], tp: MeshGroup,
                 site: Optional[str] = None) -> None:
        self.bias = bias
        grad_slot = GradGatherSlot(tp, site)
        # In backward, the gradient's all-gather is launched by the reduce-scatter's node (made in finish()) and
        # waited for here, on the partial sum: the other chunks' backward made in between runs meanwhile.
        partial = wait_for_input_grad(partial, grad_slot)
        # Async launch: waited in finish(), one step of every other chunk later.
        self.handle, self.result = reduce_scatter_to_sequence_async(partial, tp, grad_slot)

    def finish(self, residual: torch.Tensor, layer: TransformerLayer) -> torch.Tensor:
        self.handle.wait()  # wait for the reduce-scatter launched in __init__: its slice is read right here
        with tp_region_rng(layer.hidden_dropout > 0 and layer.training):
            return bias_dropout_add(self.result(), self.bias, residual, layer.hidden_dropout, layer.training,
                                    layer.kernels)

    def finish_norm(self, residual: torch.Tensor, layer: TransformerLayer, norm: torch.nn.Module):
        """:meth:`finish` and ``norm`` of its result, as one island: ``(hidden, norm(hidden))``."""
        self.handle.wait()  # wait for the reduce-scatter launched in __init__: its slice is read right here
        with tp_region_rng(layer.hidden_dropout > 0 and layer.training):
            return bias_dropout_add_norm(self.result(), self.bias, residual, layer.hidden_dropout, layer.training,
                                         norm, layer.kernels)


class StepStack:
    """What the stacks that run step programs share: the programs, the layers' asynchronous reducer, the embedding
    and the output's preparation.

    Not an ``nn.Module``: it owns no parameters, it only drives the model's own layers, so parameter names
    and checkpoints are the same with and without it.

    Args:
        model: the ``GPTModel`` whose layers it runs (at least one).
        fallback: the stack it replaces, which runs what this one cannot.
        sequence_parallel: the residual stream is this rank's sequence slice.
    """

    def __init__(self, model: torch.nn.Module, fallback, sequence_parallel: bool) -> None:
        if len(model.layers) == 0:
            raise ValueError("an overlapped layer stack needs at least one transformer layer")
        self.model = model
        self.tp: MeshGroup = model.tp  # every collective of the steps runs over the model's TP group
        self.layers: Sequence[TransformerLayer] = model.layers
        self.fallback = fallback
        self.sequence_parallel = sequence_parallel
        #: ``(start, end, checkpointed)`` layer groups; full activation recompute sets it (domino.model.recompute).
        self.units: List[Unit] = list(fallback.units)

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings; with sequence parallelism this rank's sequence slice of them (after their dropout). A
        later pipeline stage's input is already the slice the previous stage's stack returned."""
        hidden = embed_tokens(self.model, tokens, position_ids)
        if self.sequence_parallel and self.model.pre_process:
            return scatter_to_sequence_region(hidden, self.tp)
        return hidden

    def output(self, hidden: torch.Tensor, grad_slot=None) -> StackOutput:
        """The final norm's output made ready for the output layer (none without an output layer)."""
        if not self.model.post_process:
            return StackOutput(hidden, None)
        if self.sequence_parallel:  # the gather's backward reduce-scatters the input gradient
            return StackOutput(gather_from_sequence_region(hidden, self.tp), None)
        return StackOutput(hidden, grad_slot)

    def column_input(self, x: torch.Tensor, kind: str, site: str) -> Callable[[], tuple]:
        """A norm's output made ready for a column-parallel linear (the reducer's first half): ``ready``, whose
        call, when the linear runs, returns ``(input, gradient slot)``.

        Plain TP: the output with its gradient guard (the linear launches the input-gradient all-reduce into the
        slot, created now so that its wait runs after the other chunks' backward). Sequence parallelism: the
        output's all-gather, launched now and waited for in ``ready()`` (one step of every other chunk later), with
        its reduce-scatter slot: the linear launches the input gradient's reduce-scatter into it (the gather's
        backward waits for it), and keeps the slot's slice of its input instead of the gathered sequence
        (Megatron's choice: the norm outputs cost ``sbh / t``; :meth:`GradReduceScatterSlot.keep`).
        """
        site = f"bwd {kind} input grad, {site}"
        if self.sequence_parallel:
            slot = GradReduceScatterSlot(x, self.tp, site)
            # Async launch: ready() waits for it right before the linear reads it, after the other chunks' step.
            handle, gathered = gather_from_sequence_region_async(x, slot)

            def ready():
                handle.wait()  # wait for the all-gather launched at the norm: the linear reads it now
                return gathered, slot

            return ready
        guarded = guard_input_grad(x, self.tp, site)
        return lambda: guarded

    def reduce(self, row: RowParallelLinear, product: Product, kind: str, site: str):
        """Launches the reduction of a row-parallel partial sum (the reducer's second half): an all-reduce, or
        (SP) a reduce-scatter; the bias is added after it, at the residual add."""
        partial = product(None)  # this rank's partial sum; the bias is added once, after the sum
        with comm_site(f"fwd {kind}, {site}", self.tp):
            if self.sequence_parallel:  # the backward all-gather's label names the output's gradient
                return _PendingScatter(partial, row.bias, self.tp, f"bwd {kind} output grad, {site}")
            return _Pending(partial, row.bias, self.tp)

    def _site(self, index: int, chunk: int) -> str:
        """``"<first|mid|last> layer, chunk c"``: the label of a layer's waits in the comm-wait breakdown."""
        where = "first" if index == 0 else "last" if index == len(self.layers) - 1 else "mid"
        return f"{where} layer, chunk {chunk}"

    def _group_steps(self, start: int, end: int, h: torch.Tensor, mask: Optional[torch.Tensor],
                     rotary: Optional[RotaryTables], chunk: int) -> Steps:
        for index in range(start, end):
            # F of layer i and LN1 of layer i+1 share a tick (no yield between them), as in the reference order.
            h = yield from self.layers[index].steps(h, mask, rotary, self, self._site(index, chunk))
        return h

    def chunk_steps(self, start: Callable[[], torch.Tensor], mask: Optional[torch.Tensor],
                    rotary: Optional[RotaryTables], chunk: int) -> Steps:
        """One chunk's steps through every layer and the final norm; yields between steps, returns the output.

        ``start()`` returns the chunk's input when the chunk begins (Domino waits there for its embedding rows).
        """
        h = start()
        recompute = torch.is_grad_enabled()
        for first, end, checkpointed in self.units:
            if checkpointed and recompute:
                # Full recompute: run the group without keeping activations (same steps, same yields) and
                # record the RNG state before each step, so backward replays every dropout mask exactly.
                record: List = []
                out = yield from run_recorded(self._group_steps(first, end, h.detach(), mask, rotary, chunk), record)
                h = replay(h, out,
                           lambda x, first=first, end=end: self._group_steps(first, end, x, mask, rotary, chunk),
                           record)
            else:
                h = yield from self._group_steps(first, end, h, mask, rotary, chunk)
        return self.model.final_layernorm(h) if self.model.post_process else h
