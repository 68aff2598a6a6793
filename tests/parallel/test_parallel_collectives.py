"""Collectives: identities on one process; the right sums, slices and gradients on two gloo ranks."""

from __future__ import annotations

import torch

from distributed_helpers import run_distributed
from domino.parallel import collectives as C
from domino.runtime import state

FUNCS = (C.copy_to_tp_region, C.reduce_from_tp_region, C.scatter_to_tp_region, C.gather_from_tp_region)


def test_single_process_identities_need_no_distributed_init():
    assert not torch.distributed.is_initialized()
    x = torch.randn(3, 4, requires_grad=True)
    for fn in FUNCS:
        y = fn(x, C.SINGLE)
        assert torch.equal(y, x)
        (g,) = torch.autograd.grad(y.sum() * 2, x)
        assert torch.equal(g, torch.full_like(x, 2.0))
    handle = C.all_reduce_async(x.detach().clone(), C.SINGLE)
    assert handle.wait() and handle.is_completed()


def _body(rank, world_size):
    tp = state.initialize_model_parallel(2).tp
    out = {}
    x = torch.arange(8.0).reshape(2, 4) * (rank + 1)  # differs per rank
    x.requires_grad_(True)
    upstream = torch.full((2, 4), float(rank + 1))

    y = C.copy_to_tp_region(x, tp)
    y.backward(upstream.clone())  # the region sums its output gradient in place: here the one handed to backward
    out["copy"] = (y.detach(), x.grad.clone())
    x.grad = None

    y = C.reduce_from_tp_region(x, tp)
    y.backward(upstream)
    out["reduce"] = (y.detach(), x.grad.clone(), x.detach().clone())
    x.grad = None

    # A GEMM's partial sum is reduced in place (no copy); an input a backward saved fails loudly instead.
    partial = x * 1.0
    y = C.reduce_from_tp_region(partial, tp)
    y.backward(upstream)
    out["reduce in place"] = (y.detach(), x.grad.clone(), y.data_ptr() == partial.data_ptr())
    x.grad = None
    try:
        C.reduce_from_tp_region(x.exp(), tp).backward(upstream)  # exp's backward reads its own output
        out["saved input"] = "no error"
    except RuntimeError as error:
        out["saved input"] = str(error)
    x.grad = None

    y = C.scatter_to_tp_region(x, tp)
    y.backward(torch.ones_like(y))
    out["scatter"] = (y.detach(), x.grad.clone())
    x.grad = None

    y = C.gather_from_tp_region(x, tp)
    y.backward(torch.arange(16.0).reshape(2, 8))
    out["gather"] = (y.detach(), x.grad.clone())

    buf = torch.full((5,), float(rank + 1))
    handle = C.all_reduce_async(buf, tp)  # launched async, waited right below
    handle.wait()
    out["async"] = buf
    out["devices"] = [str(state.collective_device(g)) for g in (None, state.get_tensor_model_parallel_group(),
                                                                 state.get_data_parallel_group())]
    return out


def test_two_rank_semantics():
    results = run_distributed(_body, 2)
    assert all(r["devices"] == ["cpu"] * 3 for r in results)  # gloo: every collective tensor on the CPU
    base = torch.arange(8.0).reshape(2, 4)
    for rank, r in enumerate(results):
        y, g = r["copy"]
        assert torch.equal(y, base * (rank + 1))
        assert torch.equal(g, torch.full((2, 4), 3.0))  # upstream 1 + 2
        y, g, x_after = r["reduce"]
        assert torch.equal(y, base * 3)
        assert torch.equal(g, torch.full((2, 4), float(rank + 1)))  # identity backward
        assert torch.equal(x_after, base * (rank + 1))  # a leaf input itself is not reduced in place
        y, g, same_storage = r["reduce in place"]
        assert torch.equal(y, base * 3) and same_storage
        assert torch.equal(g, torch.full((2, 4), float(rank + 1)))
        assert "modified by an inplace operation" in r["saved input"]
        y, g = r["scatter"]
        assert torch.equal(y, (base * (rank + 1))[:, 2 * rank:2 * rank + 2])
        # x is replicated, so its gradient is every rank's slice gradient gathered back together.
        assert torch.equal(g, torch.ones(2, 4))
        y, g = r["gather"]
        assert torch.equal(y, torch.cat([base, base * 2], dim=1))
        assert torch.equal(g, torch.arange(16.0).reshape(2, 8)[:, 4 * rank:4 * rank + 4])
        assert torch.equal(r["async"], torch.full((5,), 3.0))


def test_collective_device_follows_the_backend(monkeypatch):
    """NCCL groups get this process's GPU (an NCCL collective rejects CPU tensors), gloo groups the CPU."""
    alone = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert state.collective_device() == alone  # no torch.distributed: where this process computes
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert state.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert state.collective_device() == torch.device("cpu")
