"""The layout is a value: one process holds two models of different TP sizes, each running over its own group.

Built from the same seed, the TP 2 model's parameters are the slices of the TP 1 model's (initialisation is
TP-invariant, ``domino.parallel.layers``), and both give the same losses and the same gradients (the TP 2 ones
merged) on the same batch, in the same process, one after the other and interleaved: nothing either model does
reads a process-wide layout. A control shows the comparison can fail."""

from __future__ import annotations

import torch

from distributed_helpers import run_distributed
from domino.checkpoint.sharding import merge_tp_shards, shard_state_dict
from domino.model import GPTModel
from domino.overlap.schedule import apply_domino
from domino.runtime import state
from domino.runtime.mesh import ParallelMesh
from model_fixtures import VOCAB, random_batch, tiny_config


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], labels=batch["labels"])
    (losses * batch["weights"]).sum().backward()
    return losses.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _body(rank, world_size):
    mesh = state.initialize_model_parallel(2)
    state.destroy_model_parallel()  # forget the global: everything below runs on the values alone
    torch.manual_seed(3)
    wide = apply_domino(GPTModel(tiny_config(), VOCAB, tp=mesh.tp), 2)  # TP 2, Domino's two chunks
    torch.manual_seed(3)
    whole = GPTModel(tiny_config(), VOCAB, tp=ParallelMesh.single().tp)  # TP 1 in the same process
    batch = random_batch(seed=8)
    out = {"slices": all(torch.equal(p, shard_state_dict(whole.state_dict(), rank, 2)[name])
                         for name, p in wide.state_dict().items())}
    out["wide"] = _loss_and_grads(wide, batch)
    out["whole"] = _loss_and_grads(whole, batch)
    out["wide again"] = _loss_and_grads(wide, batch)  # after the TP 1 model ran: unchanged
    with torch.no_grad():  # the control: one rank's slice of one weight nudged
        wide.layers[0].mlp.dense_h_to_4h.weight[0, 0] += 0.05 if rank == 0 else 0.0
    out["nudged"] = _loss_and_grads(wide, batch)[0]
    return out


def test_two_models_of_different_tp_sizes_live_in_one_process():
    results = run_distributed(_body, 2)
    for r in results:
        assert r["slices"]
        whole_losses, whole_grads = r["whole"]
        for key in ("wide", "wide again"):
            torch.testing.assert_close(r[key][0], whole_losses, rtol=1e-5, atol=1e-6)
    merged = merge_tp_shards([r["wide"][1] for r in results])
    whole_grads = results[0]["whole"][1]
    assert merged.keys() == whole_grads.keys()
    for name in whole_grads:
        torch.testing.assert_close(merged[name], whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for r in results:  # the control: the comparison sees a nudge of one element of one rank's slice
        assert not torch.allclose(r["nudged"], r["whole"][0], rtol=1e-5, atol=1e-6)
