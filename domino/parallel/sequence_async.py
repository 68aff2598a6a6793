"""Sequence parallelism's asynchronous collectives: launched now, waited for where the schedule reads them.

The synchronous sequence regions (``scatter_to_sequence_region`` and friends) are in
:mod:`domino.parallel.collectives`; these are their split-phase forms for the Domino stack
(:mod:`domino.model.domino_stack`) and the column-parallel backward (:mod:`domino.model.domino_ops`):

* :func:`gather_from_sequence_region_async` - a norm output's all-gather before a column-parallel linear;
* :func:`reduce_scatter_to_sequence_async` - a row-parallel partial sum's reduce-scatter (its backward
  all-gather may be launched into a slot too);
* :func:`gather_sequence_async`, :func:`reduce_scatter_sequence_grad_async` - the same two outside autograd,
  for backward: a saved input slice gathered again, a column-parallel input gradient reduced.

Each returns a handle; nothing it produces may be read before ``handle.wait()``. All are identities at one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from domino.runtime import state
from domino.parallel.collectives import DONE, gather_sequence, launch_async, sequence_first
from domino.runtime.network_emulator import all_gather_wire_bytes


def _tp_size() -> int:
    return state.get_tensor_model_parallel_world_size()


class _GatherSequenceAsync(torch.autograd.Function):
    """Forward: launches the all-gather of ``x`` (its handle appended to ``launched``) and returns the buffer it
    fills; backward: ``slot.reduced(grad)`` for ``x``. The launch happens inside forward so that the buffer's
    in-place write is not seen by autograd as a change after the output was made."""

    @staticmethod
    def forward(ctx, x, slot, launched):
        ctx.slot = slot
        handle, gathered = _launch_all_gather_sequence(x)
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
    def forward(ctx, partial, reduced, slot):
        ctx.slot = slot
        return reduced.view_as(reduced)

    @staticmethod
    def backward(ctx, grad):
        return (gather_sequence(grad) if ctx.slot is None else ctx.slot.launch(grad)), None, None


def _launch_all_gather_sequence(x: torch.Tensor):
    """Launches the all-gather of ``[b, s/tp, h]`` along the sequence; returns ``(handle, [b, s, h])``.

    The result is allocated as ``[b, s, h]`` with sequence-first strides, and the collective writes through its
    contiguous ``[s, b, h]`` transpose, detached: so the tensor handed back is a base, not a view, and gloo's
    in-place write into it after the launch (by its worker thread, or inside ``wait()`` on an emulated link
    with ``transfer=wait``) is no change autograd would refuse. ``x``'s slice is the send buffer (a view of
    ``x`` when ``b == 1``): do not write into ``x`` before the wait.
    """
    world, part = _tp_size(), sequence_first(x.detach())
    b, s, h = part.shape[1], world * part.shape[0], part.shape[2]
    gathered = torch.empty_strided((b, s, h), (h, b * h, 1), dtype=part.dtype, device=part.device)
    out, group = gathered.detach().transpose(0, 1), state.get_tensor_model_parallel_group()
    handle = launch_async(lambda async_op: dist.all_gather_single(out, part, group=group, async_op=async_op),
                     all_gather_wire_bytes(part.numel() * part.element_size(), world), part, "sequence all-gather")
    return handle, gathered


def gather_sequence_async(x: torch.Tensor):
    """Launches the all-gather of ``x`` (``[b, s/tp, h]``) along the sequence, outside autograd.

    Returns ``(handle, [b, s, h])``; read the result only after ``handle.wait()``. With one rank nothing is
    launched and the result is ``x``. Sequence parallelism's column-parallel backward uses it to gather a saved
    input slice again while it computes the input gradient.
    """
    if _tp_size() == 1:
        return DONE, x
    return _launch_all_gather_sequence(x)


def gather_from_sequence_region_async(x: torch.Tensor, slot):
    """Launches the all-gather of ``x`` (``[b, s/tp, h]``) along the sequence: the input of a column-parallel linear.

    Returns ``(handle, gathered)``: ``gathered`` (``[b, s, h]``, joined to ``x``'s graph) must not be read before
    ``handle.wait()``. In backward, ``slot.reduced(grad)`` gives ``x``'s gradient: the consuming linear launched
    that reduce-scatter asynchronously (``domino.model.domino_ops.GradReduceScatterSlot``), so it ran during the
    weight-gradient GEMM and whatever autograd scheduled before this node. With one rank nothing is launched.
    """
    if _tp_size() == 1:
        return DONE, x
    launched: list = []
    gathered = _GatherSequenceAsync.apply(x, slot, launched)
    return launched[0], gathered


def _launch_reduce_scatter_sequence(x: torch.Tensor):
    """Launches the reduce-scatter of ``[b, s, ...]`` along the sequence; returns ``(handle, [b, s/tp, ...])``.

    The result is not to be read before ``handle.wait()``. The send buffer is ``x`` sequence-first: a copy, or
    ``x`` itself when ``b == 1``, so do not write into ``x`` before the wait.
    """
    full = sequence_first(x.detach())
    if full.shape[0] % _tp_size():
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by the TP size {_tp_size()}")
    out, group = full.new_empty((full.shape[0] // _tp_size(), *full.shape[1:])), state.get_tensor_model_parallel_group()
    handle = launch_async(lambda async_op: dist.reduce_scatter_single(out, full, group=group, async_op=async_op),
                     all_gather_wire_bytes(out.numel() * out.element_size(), _tp_size()), full)
    return handle, out.transpose(0, 1)


def reduce_scatter_to_sequence_async(partial: torch.Tensor, grad_slot=None):
    """Launches the reduce-scatter of a row-parallel partial sum ``[b, s, h]`` along the sequence.

    Returns ``(handle, finish)``: after ``handle.wait()``, ``finish()`` returns this rank's ``[b, s/tp, h]`` sum,
    joined to ``partial``'s graph (its gradient is the all-gather of the incoming one: synchronous, or launched
    into ``grad_slot``, ``domino.model.domino_ops.GradGatherSlot``). With one rank nothing is launched and
    ``finish()`` returns ``partial``.
    """
    if _tp_size() == 1:
        return DONE, lambda: partial
    handle, out = _launch_reduce_scatter_sequence(partial)
    return handle, lambda: _ReducedScatter.apply(partial, out, grad_slot)


def reduce_scatter_sequence_grad_async(grad: torch.Tensor):
    """Launches the reduce-scatter of an input gradient ``[b, s, h]`` along the sequence, outside autograd.

    The asynchronous backward of an all-gather along the sequence (sequence parallelism's column-parallel
    inputs, :mod:`domino.model.domino_ops`). Returns ``(handle, [b, s/tp, h])``; read the slice only after
    ``handle.wait()``. With one rank nothing is launched and the slice is ``grad`` itself.
    """
    if _tp_size() == 1:
        return DONE, grad
    return _launch_reduce_scatter_sequence(grad)
