"""Tensor-parallel collectives: each written once, asynchronously, and Megatron's "regions" built on them.

Every collective is one ``*_async`` function that launches it over an explicit process group and returns a handle
(:class:`domino.runtime.comm_timing.CommHandle`, which times the wait and rides the emulated link); its synchronous
form is that launch followed by the wait. Domino's schedule (:mod:`domino.overlap`) calls the asynchronous forms
and waits where it reads the result; everything else uses the synchronous ones or the regions below.

The regions are small autograd functions naming what happens in the forward pass; the backward pass is its
adjoint:

==========================  ==========================  ==========================
function                    forward                     backward
==========================  ==========================  ==========================
copy_to_tp_region           identity                    all-reduce (sum)
reduce_from_tp_region       all-reduce (sum)            identity
scatter_to_tp_region        keep this rank's last-dim   all-gather along last dim
                            slice
gather_from_tp_region       all-gather along last dim   keep this rank's slice
scatter_to_sequence_region  keep this rank's sequence    all-gather along sequence
                            slice (dim 0)
gather_from_sequence_region all-gather along sequence    reduce-scatter along
                                                        sequence
reduce_scatter_to_sequence  reduce-scatter along         all-gather along sequence
_region                     sequence
all_to_all_region           piece j of dim 0 to rank j  the same all-to-all
==========================  ==========================  ==========================

As in Megatron-LM's ``megatron/core/tensor_parallel/mappings.py`` (NVIDIA/Megatron-LM 00caa53a:
``copy_to_tensor_model_parallel_region(input_, group=None)`` keeps the group in ``ctx.group``), every region
and collective takes its group as an argument: a :class:`~domino.runtime.mesh.MeshGroup` of the run's mesh (the
process group and the emulated link it rides), passed down by the layer that owns it, never read from a global
(Megatron core passes its ``ProcessGroupCollection`` the same way); the sequence functions are Megatron's
``*_sequence_parallel_region``, along dimension 0 of the ``[s, b, h]`` activations (Megatron's layout, kept from
the embedding to the output layer by :mod:`domino.model.gpt_model`), so every send and receive buffer is a
contiguous activation or a contiguous slice of one: no transpose, no copy. All of them are identities when the
group has one rank, so a single process needs no ``torch.distributed`` at all.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from domino.runtime.comm_timing import DONE, CommHandle, comm_site, launch  # noqa: F401  (comm_site: one import)
from domino.runtime.mesh import SINGLE, MeshGroup  # noqa: F401  (SINGLE: the group of one, for callers)
from domino.runtime.network_emulator import all_gather_wire_bytes, all_reduce_wire_bytes

Group = MeshGroup


# ---- the collectives: launched asynchronously; the synchronous form waits at once -------------------------------

def all_reduce_async(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM,
                     kind: str = "async", blocking: bool = False):
    """Launches an in-place all-reduce of ``x`` over ``group`` and returns its handle.

    Outside autograd on purpose: Domino uses it on a row-parallel partial sum, whose gradient with respect
    to each rank's partial is the incoming gradient itself, so autograd must see an identity. The caller must
    not read or write ``x`` until ``handle.wait()`` returned. With one rank nothing is launched.

    Args:
        x: a contiguous tensor, reduced in place.
        group: the mesh group (a TP group) to reduce over.
        op: the reduction.
        kind: the comm-wait label outside any ``comm_site``.
        blocking: the caller waits at once (the synchronous form).
    """
    world = group.size
    if world == 1:
        return DONE
    if not x.is_contiguous():
        raise ValueError("all_reduce_async needs a contiguous tensor (it reduces in place)")
    data = x.detach()
    return launch(lambda async_op: dist.all_reduce(data, op=op, group=group.process_group, async_op=async_op),
                  all_reduce_wire_bytes(x.numel() * x.element_size(), world), x, group, kind, blocking)


def all_reduce_(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM,
                kind: str = "cross-entropy") -> torch.Tensor:
    """Sums (``op``) the contiguous ``x`` in place over ``group``, outside autograd; returns ``x``."""
    all_reduce_async(x, group, op, kind, blocking=True).wait()  # synchronous: launch and wait at once
    return x


def all_reduce_sum_(x: torch.Tensor, group: Group) -> torch.Tensor:
    """In-place sum over ``group``, outside autograd."""
    return all_reduce_(x, group)


def all_reduce_max_(x: torch.Tensor, group: Group) -> torch.Tensor:
    """In-place max over ``group``, outside autograd (the vocab-parallel cross-entropy)."""
    return all_reduce_(x, group, dist.ReduceOp.MAX)


def all_gather_sequence_async(x: torch.Tensor, group: Group, kind: str = "sequence all-gather",
                              blocking: bool = False) -> Tuple[object, torch.Tensor]:
    """Launches the all-gather of ``[s/tp, b, h]`` along the sequence, outside autograd; ``(handle, [s, b, h])``.

    The sequence is dimension 0, so each rank's slice is one contiguous block of the result: the collective writes
    straight into the tensor handed back, through a detached alias, so gloo's in-place write after the launch (by
    its worker thread, or inside ``wait()`` on an emulated link with ``transfer=wait``, when the result may already
    be an autograd output) is no change autograd would refuse. ``x`` itself is the send buffer: do not write into
    it before the wait. With one rank nothing is launched and the result is ``x``.
    """
    world = group.size
    if world == 1:
        return DONE, x
    part = _contiguous(x.detach())
    gathered = part.new_empty((world * part.shape[0], *part.shape[1:]))
    sink = gathered.detach()
    handle = launch(lambda async_op: dist.all_gather_single(sink, part, group=group.process_group,
                                                            async_op=async_op),
                    all_gather_wire_bytes(part.numel() * part.element_size(), world), part, group, kind, blocking)
    return handle, gathered


def all_gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gathers ``[s/tp, b, h]`` along the sequence, synchronously and outside autograd: ``[s, b, h]``."""
    handle, gathered = all_gather_sequence_async(x, group, blocking=True)
    handle.wait()  # synchronous: launched and waited for at once
    return gathered


def reduce_scatter_sequence_async(x: torch.Tensor, group: Group, kind: str = "async",
                                  blocking: bool = False) -> Tuple[object, torch.Tensor]:
    """Launches the reduce-scatter of ``[s, b, ...]`` along the sequence, outside autograd; returns
    ``(handle, [s/tp, b, ...])``, this rank's slice of the sum, not to be read before ``handle.wait()``.

    ``x`` itself is the send buffer (each rank's share is a contiguous block of it), so do not write into it before
    the wait. With one rank nothing is launched and the slice is ``x`` itself.
    """
    world = group.size
    if world == 1:
        return DONE, x
    full = _contiguous(x.detach())
    if full.shape[0] % world:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by the TP size {world}")
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    handle = launch(lambda async_op: dist.reduce_scatter_single(out, full, group=group.process_group,
                                                                async_op=async_op),
                    all_gather_wire_bytes(out.numel() * out.element_size(), world), full, group, kind, blocking)
    return handle, out


def reduce_scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Reduce-scatters ``[s, b, ...]`` along the sequence, synchronously and outside autograd: ``[s/tp, b, ...]``."""
    handle, part = reduce_scatter_sequence_async(x, group, "sequence reduce-scatter", blocking=True)
    handle.wait()  # synchronous: launched and waited for at once
    return part


def all_to_all(x: torch.Tensor, group: Group, kind: str = "all-to-all") -> torch.Tensor:
    """Sends piece ``j`` of ``x``'s ``group.size`` equal pieces along dimension 0 to rank ``j`` and returns the
    pieces received, in rank order (synchronously, outside autograd); ``x`` itself with one rank."""
    world = group.size
    if world == 1:
        return x
    send = _contiguous(x.detach())
    if send.shape[0] % world:
        raise ValueError(f"dimension 0 of size {send.shape[0]} does not cut into {world} equal pieces")
    received = torch.empty_like(send)
    handle = launch(lambda async_op: dist.all_to_all_single(received, send, group=group.process_group,
                                                            async_op=async_op),
                    all_gather_wire_bytes(send.numel() * send.element_size() // world, world), send, group, kind,
                    blocking=True)
    handle.wait()  # synchronous: launched and waited for at once
    return received


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself: the activations and their gradients are contiguous ``[s, b, h]`` tensors (a copy is made only
    for an odd strided caller, such as a gradient autograd expanded from a scalar)."""
    return x if x.is_contiguous() else x.contiguous()


def all_gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenates every rank's ``x`` along the last dimension (synchronously, outside autograd)."""
    world = group.size
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    handle = launch(lambda async_op: dist.all_gather(parts, x, group=group.process_group, async_op=async_op),
                    all_gather_wire_bytes(x.numel() * x.element_size(), world), x, group, "all-gather",
                    blocking=True)
    handle.wait()  # synchronous: launched and waited for at once
    return torch.cat(parts, dim=-1)


def _split(x: torch.Tensor, dim: int, group: Group, what: str) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (no communication)."""
    world = group.size
    if x.shape[dim] % world:
        raise ValueError(f"{what} {x.shape[dim]} is not divisible by the TP size {world}")
    return x.chunk(world, dim=dim)[group.rank].contiguous()


# ---- the regions ------------------------------------------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # In place, as Megatron-LM's _reduce: what arrives is the input gradient the column-parallel linear after
        # this region just computed (or autograd's sum of several), a tensor nothing else holds. (A tensor handed
        # to backward() as this region's own output gradient would be summed in place too.)
        return all_reduce_(grad.contiguous(), ctx.group, kind="all-reduce bwd"), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        # In place, as Megatron-LM's _reduce: x is a row-parallel GEMM's partial sum, which no backward saves
        # (a linear keeps its input and weight). mark_dirty bumps x's version, so an input some backward did
        # save fails loudly there instead of reading the sum; a leaf that requires grad cannot change, and is
        # copied.
        if x.is_leaf and x.requires_grad:
            x = x.clone()
        reduced = all_reduce_(x.contiguous(), group, kind="all-reduce fwd")
        if reduced is x:
            ctx.mark_dirty(x)
        return reduced

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group, "last dimension")

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group, "last dimension"), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # A slice along dim 0 is a view that would keep the whole [s, b, h] input alive as long as the slice lives;
        # the clone lets it go (Megatron's clone_scatter_output_in_embedding, on by default, does the same).
        return _split(x, 0, group, "sequence length").clone()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x, group, "all-to-all fwd")

    @staticmethod
    def backward(ctx, grad):
        # Its own adjoint: what rank r sent rank j as piece j comes back from rank j's gradient as its piece r.
        return all_to_all(grad, ctx.group, "all-to-all bwd"), None


def _region(function, x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else function.apply(x, group)


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduces the gradient (the input of a column-parallel layer)."""
    return _region(_CopyToRegion, x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduces forward; identity backward (the output of a row-parallel layer)."""
    return _region(_ReduceFromRegion, x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keeps this rank's slice of the last dimension; gathers the gradient."""
    return _region(_ScatterToRegion, x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenates the ranks' slices along the last dimension; splits the gradient."""
    return _region(_GatherFromRegion, x, group)


def scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keeps this rank's slice of the sequence (dimension 0 of ``[s, b, h]``); all-gathers the gradient."""
    return _region(_ScatterToSequence, x, group)


def gather_from_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gathers the sequence (the input of a column-parallel layer); reduce-scatters the gradient."""
    return _region(_GatherFromSequence, x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sums over the TP ranks keeping this rank's sequence slice (the output of a row-parallel layer)."""
    return _region(_ReduceScatterToSequence, x, group)


def all_to_all_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Piece ``j`` of dimension 0 to rank ``j``, the received pieces in rank order (context parallelism's exchange
    of sequence for heads); the gradient goes back by the same all-to-all."""
    return _region(_AllToAll, x, group)
