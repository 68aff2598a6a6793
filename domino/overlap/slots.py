"""Gradient slots: where a column-parallel linear's backward launches its input gradient's reduction, and the
no-op nodes that wait for it later.

A column-parallel linear's input gradient must be summed over the TP ranks. Synchronous TP does that inside
the linear's backward; Domino instead *launches* the all-reduce there, computes the weight and bias gradients
while it runs, and returns the still-in-flight gradient. A no-op node placed between the LayerNorm and the
linear (so it runs right after the linear's backward, just before LayerNorm's backward consumes the gradient)
waits for it. Between launch and wait, autograd is free to run nodes of the other chunk(s).

    LN -> wait_for_input_grad(x, slot) -> ... other chunks' work ... -> linear(x, W, b, grad_slot=slot)

The two share a slot, which carries the handle from launch to wait. Every slot handed to a linear implements
:class:`domino.parallel.linear_ops.GradSlot`, the protocol declared beside the linears that call it:
:class:`GradAllReduceSlot` (plain TP) and :class:`GradReduceScatterSlot` (sequence parallelism: the input was
all-gathered, so its gradient is reduce-scattered and only the input's slice is kept).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from domino.parallel.collectives import (
    MeshGroup, all_gather_sequence_async, all_reduce_async, comm_site, reduce_scatter_sequence_async,
)


class GradAllReduceSlot:
    """Holds the handle of one in-flight input-gradient all-reduce (a :class:`~domino.parallel.linear_ops.GradSlot`)."""

    __slots__ = ("handle", "group", "site")

    def __init__(self, group: MeshGroup, site: Optional[str] = None) -> None:
        self.handle = None
        self.group = group  # the TP group the gradient is reduced over
        self.site = site

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """The linear keeps its whole input."""
        return x

    def restore(self, kept: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The kept input, as it is."""
        return lambda: kept

    def launch(self, grad: torch.Tensor) -> None:
        """Starts the in-place all-reduce of ``grad`` over the TP group; :meth:`wait` waits for it."""
        with comm_site(self.site, self.group):
            self.handle = all_reduce_async(grad, self.group)

    def wait(self) -> None:
        """Blocks until the launched collective (if any) finished."""
        if self.handle is not None:
            # Wait for the gradient collective launched in backward (a linear's input-gradient all-reduce, or
            # GradGatherSlot's all-gather): the next node reads the gradient.
            self.handle.wait()
            self.handle = None


class GradReduceScatterSlot:
    """Sequence parallelism's :class:`GradAllReduceSlot`: a column-parallel linear's input was all-gathered along
    the sequence, so its input gradient is reduce-scattered back to this rank's slice instead of all-reduced.

    The linear's backward launches the reduce-scatter (:meth:`launch`); the gather's backward, which autograd
    reaches after the weight-gradient GEMM and the other chunks' work created in between, takes the slice
    (:meth:`reduced`) -- Megatron overlaps the same reduce-scatter with the weight gradient
    (``LinearWithGradAccumulationAndAsyncCommunication``, ``megatron/core/tensor_parallel/layers.py``).
    """

    __slots__ = ("handle", "launched", "part", "group", "result", "site")

    def __init__(self, part: torch.Tensor, group: MeshGroup, site: Optional[str] = None) -> None:
        self.handle = self.launched = self.result = None
        #: This rank's slice of the linear's input: the linear keeps it instead of the gathered sequence.
        self.part = part
        self.group = group  # the TP group the sequence is split over
        self.site = site

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """The linear keeps this rank's slice, not the gathered ``x`` (Megatron's choice: ``sbh / t`` per norm)."""
        return self.part

    def restore(self, kept: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Launches the all-gather of the kept slice; returns a callable that waits and returns the sequence."""
        with comm_site(self.site, self.group):
            handle, gathered = all_gather_sequence_async(kept, self.group)

        def ready() -> torch.Tensor:
            handle.wait()  # wait for the slice's all-gather launched before the input-gradient GEMM
            return gathered

        return ready

    def launch(self, grad: torch.Tensor) -> None:
        """Starts the reduce-scatter of ``grad`` (``[s, b, h]``) along the sequence over the TP group."""
        with comm_site(self.site, self.group):
            self.handle, self.result = reduce_scatter_sequence_async(grad, self.group)
        self.launched = grad

    def reduced(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's ``[s/tp, b, h]`` slice of ``grad`` summed over the TP ranks.

        ``grad`` is what autograd hands the gather's backward: the very tensor launched when the linear is the
        gather's only consumer. Anything else (another consumer added its gradient) is reduce-scattered here,
        synchronously, so the result is right either way.
        """
        launched, handle, result = self.launched, self.handle, self.result
        self.handle = self.launched = self.result = None
        if handle is None or launched is not grad:
            if handle is not None:
                handle.wait()  # a launched but unused reduce-scatter still has to finish on every rank
            with comm_site(self.site, self.group):
                handle, result = reduce_scatter_sequence_async(grad, self.group)
        # Wait for the reduce-scatter launched by the linear's backward: the slice is LayerNorm's input gradient.
        handle.wait()
        return result


class GradGatherSlot(GradAllReduceSlot):
    """The gradient of a row-parallel sum that sequence parallelism reduce-scattered: the all-gather of the incoming
    slice gradients, launched by the reduce-scatter's backward (:meth:`launch`) and waited for by a node placed on
    the partial sum when it was computed (:meth:`wait`, via :func:`wait_for_input_grad`). Between the two, autograd
    runs the other chunks' backward created in forward between the partial sum and the wait for its reduce-scatter.
    """

    __slots__ = ()

    def launch(self, grad: torch.Tensor) -> torch.Tensor:
        """Starts the all-gather of ``grad`` (``[s/tp, b, h]``); returns the ``[s, b, h]`` buffer it fills."""
        with comm_site(self.site, self.group):
            self.handle, gathered = all_gather_sequence_async(grad, self.group)
        return gathered


class _WaitInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot):
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.wait()  # the summed gradient is needed now, by LayerNorm's backward
        return grad, None


def wait_for_input_grad(x: torch.Tensor, slot: GradAllReduceSlot) -> torch.Tensor:
    """Identity forward; in backward, waits for the gradient collective registered in ``slot``."""
    return _WaitInputGrad.apply(x, slot)


def guard_input_grad(x: torch.Tensor, group: MeshGroup, site: Optional[str] = None
                     ) -> Tuple[torch.Tensor, GradAllReduceSlot]:
    """Places the wait node on ``x`` (a LayerNorm output) and returns it with the slot a linear will fill (its
    all-reduce over ``group``, the TP group).

    ``site`` labels the all-reduce's blocked time (:func:`domino.runtime.comm_timing.comm_site`).

    Create the guard as soon as ``x`` exists and run the consuming linear later: autograd runs nodes in
    reverse creation order, so whatever is created in between (the other chunks' work) runs in backward
    between the linear's all-reduce launch and this wait.
    """
    slot = GradAllReduceSlot(group, site)
    return wait_for_input_grad(x, slot), slot
