"""Sequence parallelism's split-phase regions: launched now, waited for where the schedule reads them.

The collectives themselves are :mod:`domino.parallel.collectives`' (``all_gather_sequence_async``,
``reduce_scatter_sequence_async``: written once, the synchronous regions being their launch plus wait); these are
the autograd functions that put a launch in one step and its wait in a later one, with a gradient slot
(:mod:`domino.overlap.slots`) carrying the backward collective from its launch to its wait:

* :func:`gather_from_sequence_region_async` - a norm output's all-gather before a column-parallel linear;
* :func:`reduce_scatter_to_sequence_async` - a row-parallel partial sum's reduce-scatter (its backward
  all-gather may be launched into a slot too).

Each returns a handle; nothing it produces may be read before ``handle.wait()``. Both are identities at one rank.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from domino.overlap.slots import GradGatherSlot, GradReduceScatterSlot
from domino.parallel.collectives import (
    DONE, MeshGroup, all_gather_sequence, all_gather_sequence_async, reduce_scatter_sequence_async,
)


class _GatherSequenceAsync(torch.autograd.Function):
    """Forward: launches the all-gather of ``x`` (its handle appended to ``launched``) and returns the buffer it
    fills; backward: ``slot.reduced(grad)`` for ``x``. The launch happens inside forward so that the buffer's
    in-place write is not seen by autograd as a change after the output was made."""

    @staticmethod
    def forward(ctx, x, slot, launched):
        ctx.slot = slot
        # Async launch: the caller waits for the handle right before the linear reads the gathered sequence.
        handle, gathered = all_gather_sequence_async(x, slot.group)
        launched.append(handle)
        return gathered

    @staticmethod
    def backward(ctx, grad):
        return ctx.slot.reduced(grad), None, None


class _ReducedScatter(torch.autograd.Function):
    """Forward: the already reduce-scattered ``reduced``; backward: the adjoint for ``partial``, an all-gather.

    Without a slot the all-gather is synchronous. With one, it is launched into ``slot.launch(grad)``, which
    returns the buffer being filled; the slot's wait node, placed on ``partial`` when it was made, waits for it.
    """

    @staticmethod
    def forward(ctx, partial, reduced, group, slot):
        ctx.group, ctx.slot = group, slot
        return reduced.view_as(reduced)

    @staticmethod
    def backward(ctx, grad):
        gathered = all_gather_sequence(grad, ctx.group) if ctx.slot is None else ctx.slot.launch(grad)
        return gathered, None, None, None


def gather_from_sequence_region_async(x: torch.Tensor, slot: GradReduceScatterSlot) -> Tuple[object, torch.Tensor]:
    """Launches the all-gather of ``x`` (``[s/tp, b, h]``) along the sequence: the input of a column-parallel linear.

    Returns ``(handle, gathered)``: ``gathered`` (``[s, b, h]``, joined to ``x``'s graph) must not be read before
    ``handle.wait()``. In backward, ``slot.reduced(grad)`` gives ``x``'s gradient: the consuming linear launched
    that reduce-scatter asynchronously (:class:`~domino.overlap.slots.GradReduceScatterSlot`), so it ran during
    the weight-gradient GEMM and whatever autograd scheduled before this node. With one rank nothing is launched.
    """
    if slot.group.size == 1:
        return DONE, x
    launched: list = []
    gathered = _GatherSequenceAsync.apply(x, slot, launched)
    return launched[0], gathered


def reduce_scatter_to_sequence_async(partial: torch.Tensor, group: MeshGroup,
                                     grad_slot: Optional[GradGatherSlot] = None
                                     ) -> Tuple[object, Callable[[], torch.Tensor]]:
    """Launches the reduce-scatter of a row-parallel partial sum ``[s, b, h]`` along the sequence of ``group``
    (the TP group).

    Returns ``(handle, finish)``: after ``handle.wait()``, ``finish()`` returns this rank's ``[s/tp, b, h]`` sum,
    joined to ``partial``'s graph (its gradient is the all-gather of the incoming one: synchronous, or launched
    into ``grad_slot``, :class:`~domino.overlap.slots.GradGatherSlot`). With one rank nothing is launched and
    ``finish()`` returns ``partial``.
    """
    if group.size == 1:
        return DONE, lambda: partial
    # Async launch: the caller waits for the handle one step of every other chunk later.
    handle, out = reduce_scatter_sequence_async(partial, group)
    return handle, lambda: _ReducedScatter.apply(partial, out, group, grad_slot)
