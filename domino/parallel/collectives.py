"""Tensor-parallel collectives as small autograd functions (Megatron's "regions").

Each function names what happens in the forward pass; the backward pass is its adjoint:

==========================  ==========================  ==========================
function                    forward                     backward
==========================  ==========================  ==========================
copy_to_tp_region           identity                    all-reduce (sum)
reduce_from_tp_region       all-reduce (sum)            identity
scatter_to_tp_region        keep this rank's last-dim   all-gather along last dim
                            slice
gather_from_tp_region       all-gather along last dim   keep this rank's slice
scatter_to_sequence_region  keep this rank's sequence    all-gather along sequence
                            slice (dim 1)
gather_from_sequence_region all-gather along sequence    reduce-scatter along
                                                        sequence
reduce_scatter_to_sequence  reduce-scatter along         all-gather along sequence
_region                     sequence
==========================  ==========================  ==========================

The sequence functions are Megatron's sequence parallelism (``megatron/core/tensor_parallel/mappings.py``: the
``*_sequence_parallel_region`` functions), along dimension 1 of our ``[b, s, h]`` tensors.

All of them are identities when the tensor-parallel group has one rank, so a single process needs no
``torch.distributed`` at all. ``all_reduce_async`` is the building block of the Domino schedule: it launches
an in-place all-reduce and hands back a handle to wait on later (:func:`launch_async` launches every such
collective, on the emulated link when there is one); sequence parallelism's split-phase collectives are in
:mod:`domino.parallel.sequence_async`.

Every collective here runs over the TP group, counts the host time it blocks (the ``comm-wait`` timer,
:mod:`domino.runtime.comm_timing`) and, when ``DOMINO_SIMULATED_NETWORK`` is set, lasts at least the time
of the emulated link (:mod:`domino.runtime.network_emulator`): synchronous ones sleep the remainder before
returning, asynchronous ones in ``wait()``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from domino.runtime import state
from domino.runtime.comm_timing import (  # noqa: F401  (the timers are read through this module too)
    TimedWork, comm_site, count_blocked, current_site, pop_comm_wait_by_site, pop_comm_wait_seconds,
    pop_modelled_comm_seconds,
)
from domino.runtime.network_emulator import (
    DeferredWork, EmulatedWork, all_gather_wire_bytes, all_reduce_wire_bytes,
)


class _DoneHandle:
    """Stands in for a ``dist.Work`` when nothing was launched (one rank): ``wait()`` returns at once."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _DoneHandle()

def _tp_size() -> int:
    return state.get_tensor_model_parallel_world_size()


def _blocking(run, wire_bytes: float, kind: str) -> None:
    """Runs the synchronous collective ``run()``, for at least the emulated link's time; counts the blocking
    under the current :func:`comm_site`, else under ``kind``."""
    link = state.get_tensor_model_parallel_link()
    started = time.perf_counter()
    due = link.launch(wire_bytes) if link is not None else None
    run()
    if due is not None:
        link.wait_until(due)
    count_blocked(time.perf_counter() - started, current_site(kind))


def _all_reduce_in_place(x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                         kind: str = "cross-entropy") -> torch.Tensor:
    _blocking(lambda: dist.all_reduce(x, op=op, group=state.get_tensor_model_parallel_group()),
              all_reduce_wire_bytes(x.numel() * x.element_size(), _tp_size()), kind)
    return x


def _all_reduce(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Sums ``x`` in place over the TP group (contiguous first, since collectives need dense memory)."""
    if _tp_size() == 1:
        return x
    return _all_reduce_in_place(x.contiguous(), kind=kind)


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = _tp_size()
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the TP size {world}")
    return x.chunk(world, dim=-1)[state.get_tensor_model_parallel_rank()].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = _tp_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    _blocking(lambda: dist.all_gather(parts, x, group=state.get_tensor_model_parallel_group()),
              all_gather_wire_bytes(x.numel() * x.element_size(), world), "all-gather")
    return torch.cat(parts, dim=-1)


def sequence_first(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, ...]`` -> contiguous ``[s, b, ...]``: collectives split and join the first dimension."""
    return x.transpose(0, 1).contiguous()


def _split_sequence(x: torch.Tensor) -> torch.Tensor:
    world = _tp_size()
    if x.shape[1] % world:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the TP size {world}")
    return x.chunk(world, dim=1)[state.get_tensor_model_parallel_rank()].contiguous()


def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """All-gathers ``[b, s/tp, ...]`` along the sequence (synchronously, outside autograd): ``[b, s, ...]``."""
    world, part = _tp_size(), sequence_first(x)
    out = part.new_empty((world * part.shape[0], *part.shape[1:]))
    _blocking(lambda: dist.all_gather_single(out, part, group=state.get_tensor_model_parallel_group()),
              all_gather_wire_bytes(part.numel() * part.element_size(), world), "sequence all-gather")
    return out.transpose(0, 1)


def _reduce_scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    world, full = _tp_size(), sequence_first(x)
    if full.shape[0] % world:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by the TP size {world}")
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    _blocking(lambda: dist.reduce_scatter_single(out, full, group=state.get_tensor_model_parallel_group()),
              all_gather_wire_bytes(out.numel() * out.element_size(), world), "sequence reduce-scatter")
    return out.transpose(0, 1)


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad)


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return gather_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad)


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_sequence(x)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), "all-reduce bwd")


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone(), "all-reduce fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


def copy_to_tp_region(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduces the gradient (the input of a column-parallel layer)."""
    return x if _tp_size() == 1 else _CopyToRegion.apply(x)


def reduce_from_tp_region(x: torch.Tensor) -> torch.Tensor:
    """All-reduces forward; identity backward (the output of a row-parallel layer)."""
    return x if _tp_size() == 1 else _ReduceFromRegion.apply(x)


def scatter_to_tp_region(x: torch.Tensor) -> torch.Tensor:
    """Keeps this rank's slice of the last dimension; gathers the gradient."""
    return x if _tp_size() == 1 else _ScatterToRegion.apply(x)


def gather_from_tp_region(x: torch.Tensor) -> torch.Tensor:
    """Concatenates the ranks' slices along the last dimension; splits the gradient."""
    return x if _tp_size() == 1 else _GatherFromRegion.apply(x)


def scatter_to_sequence_region(x: torch.Tensor) -> torch.Tensor:
    """Keeps this rank's slice of the sequence (dimension 1); all-gathers the gradient."""
    return x if _tp_size() == 1 else _ScatterToSequence.apply(x)


def gather_from_sequence_region(x: torch.Tensor) -> torch.Tensor:
    """All-gathers the sequence (the input of a column-parallel layer); reduce-scatters the gradient."""
    return x if _tp_size() == 1 else _GatherFromSequence.apply(x)


def reduce_scatter_to_sequence_region(x: torch.Tensor) -> torch.Tensor:
    """Sums over the TP ranks keeping this rank's sequence slice (the output of a row-parallel layer)."""
    return x if _tp_size() == 1 else _ReduceScatterToSequence.apply(x)


class PendingWork(TimedWork):
    """A timed work that also keeps the collective's send buffer alive until it is waited on."""

    __slots__ = ("source",)

    def __init__(self, work, source: torch.Tensor, kind: str = "async") -> None:
        super().__init__(work, kind)
        self.source = source

    def wait(self) -> bool:
        try:
            return super().wait()
        finally:
            self.source = None  # the collective has read it: let the send buffer go


def launch_async(collective, wire_bytes: float, source: torch.Tensor, kind: str = "async") -> PendingWork:
    """Launches ``collective(async_op)`` over the TP group, on the emulated link when there is one.

    Returns its handle (keeping ``source``, the send buffer, alive until waited on). With an emulated link whose
    transfer happens in ``wait()``, gloo runs the collective there, synchronously, after the link's time.
    """
    link = state.get_tensor_model_parallel_link()
    due = link.launch(wire_bytes) if link is not None else None
    if link is not None and link.spec.transfer == "wait":  # emulated link, gloo moves the data in wait()
        return PendingWork(DeferredWork(lambda: collective(False), link, due), source, kind)
    # Async launch: the caller computes meanwhile and reads the result only after the handle's wait().
    work = collective(True)
    return PendingWork(work if link is None else EmulatedWork(work, link, due), source, kind)


def all_reduce_async(x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM):
    """Launches an in-place all-reduce of ``x`` over the TP group and returns its handle.

    Outside autograd on purpose: Domino uses it on a row-parallel partial sum, whose gradient with respect
    to each rank's partial is the incoming gradient itself, so autograd must see an identity. The caller must
    not read or write ``x`` until ``handle.wait()`` returned. With one rank nothing is launched.

    Args:
        x: a contiguous tensor, reduced in place.
        op: the reduction.

    Returns:
        An object with ``wait()``: a ``torch.distributed.Work`` or a completed stand-in.
    """
    if _tp_size() == 1:
        return DONE
    if not x.is_contiguous():
        raise ValueError("all_reduce_async needs a contiguous tensor (it reduces in place)")
    group = state.get_tensor_model_parallel_group()
    # Async launch: the caller computes another chunk meanwhile and waits right before it reads x.
    return launch_async(lambda async_op: dist.all_reduce(x.detach(), op=op, group=group, async_op=async_op),
                        all_reduce_wire_bytes(x.numel() * x.element_size(), _tp_size()), x)


def all_reduce_max_(x: torch.Tensor) -> torch.Tensor:
    """In-place max over the TP group, outside autograd (used by the vocab-parallel cross-entropy)."""
    return _all_reduce_in_place(x, dist.ReduceOp.MAX) if _tp_size() > 1 else x


def all_reduce_sum_(x: torch.Tensor) -> torch.Tensor:
    """In-place sum over the TP group, outside autograd."""
    return _all_reduce_in_place(x) if _tp_size() > 1 else x


def tp_rank_and_size() -> tuple:
    """``(rank, world_size)`` of this process inside its tensor-parallel group."""
    return state.get_tensor_model_parallel_rank(), _tp_size()
