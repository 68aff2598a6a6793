"""Sequence parallelism at TP=2 (gloo): the same losses and gradients as plain TP, less activation memory per rank,
the sequence collectives are each other's adjoints, and backward overlaps the input gradients' reduce-scatters."""

from __future__ import annotations

import pytest
import torch

from distributed_helpers import run_distributed
from domino.config import ModelConfig
from domino.model.recompute import RecomputePlan, apply_activation_recompute
from domino.runtime import state
from domino.parallel.random import model_parallel_seed
from model_fixtures import build_model, train_and_measure

VOCAB = 128
REL = 1e-4  # the bound; measured: identical to the last printed digit
SETTINGS = [(chunks, sp, recompute) for chunks in (1, 2) for sp in (False, True) for recompute in (False, True)]


def _config(dropout: float = 0.0) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=dropout,
                       attention_dropout=dropout)


def _train(chunks: int, sp: bool, recompute: bool, dropout: float = 0.0):
    model_parallel_seed(3, state.current_mesh().tp.rank)
    model = build_model(_config(dropout), VOCAB, chunks, sequence_parallel=sp)
    apply_activation_recompute(model, RecomputePlan("full", "uniform", 1) if recompute else None)
    return train_and_measure(model, VOCAB)


_HEAVY = ("aten.mm", "aten.addmm", "aten.bmm", "flash_attention")


def _overlap_logs(chunks: int) -> dict:
    """One SP training step at TP=2 recording, in order, every matmul and attention kernel and each sequence
    collective's launch and wait: the norm outputs' all-gathers in forward, the input gradients' reduce-scatters
    in backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import domino.overlap.sequence_collectives as sequence_collectives
    import domino.overlap.slots as slots

    logs = {"forward": [], "backward": []}
    log = logs["forward"]

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(name in str(func) for name in _HEAVY):
                log.append(("op", None))
            return func(*args, **(kwargs or {}))

    class LoggedHandle:
        def __init__(self, handle, ident, into):
            self.handle, self.ident, self.into = handle, ident, into

        def wait(self):
            self.into.append(("wait", self.ident))
            return self.handle.wait()

    def logged(real, name):
        def launch(tensor, group):
            handle, result = real(tensor, group)
            label = name if "output grad" not in group.timer.current_site("") else "output-grad all-gather"
            ident = (label, sum(1 for kind, _ in log if kind == "launch"))
            log.append(("launch", ident))
            return LoggedHandle(handle, ident, log), result
        return launch

    # The norm outputs' all-gathers (forward), the kept slices' and the row-parallel gradients' all-gathers and
    # the input gradients' reduce-scatters (backward).
    patched = [(sequence_collectives, "all_gather_sequence_async", "all-gather"),
               (slots, "all_gather_sequence_async", "all-gather"),
               (slots, "reduce_scatter_sequence_async", "reduce-scatter")]
    real = [getattr(module, name) for module, name, _ in patched]
    for (module, name, label), function in zip(patched, real):
        setattr(module, name, logged(function, label))
    try:
        model_parallel_seed(3, state.current_mesh().tp.rank)
        model = build_model(_config(), VOCAB, chunks, sequence_parallel=True)
        tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
        with Recorder():
            loss = model(tokens, labels=tokens).mean()
            log = logs["backward"]
            loss.backward()
    finally:
        for (module, name, _), function in zip(patched, real):
            setattr(module, name, function)
    return logs


def _ops_between_launch_and_wait(log: list, name: str) -> list:
    """Heavy ops between each ``name`` collective's launch and its first wait, in launch order."""
    where = {}
    for i, (kind, ident) in enumerate(log):
        if kind != "op" and ident[0] == name:
            where.setdefault(ident, {}).setdefault(kind, i)  # the first wait is the one that blocks
    assert all(set(w) == {"launch", "wait"} for w in where.values()), "a launch was never waited on"
    return [sum(1 for kind, _ in log[w["launch"] + 1:w["wait"]] if kind == "op") for w in where.values()]


# A transposed or strided tensor made contiguous is an aten.clone. copy_ is left out: gloo writes each
# reduce-scatter's result into the output buffer with copy_ inside wait() (the backend's own, in either layout).
_COPIES = ("aten.clone", "aten._to_copy")


def _activation_copies(sequence_parallel: bool) -> list:
    """``(op, shape)`` of every copy made of an activation-sized tensor (``s b h`` or ``s b h / tp`` elements) in
    one training step at TP=2, 1 chunk: the sequence collectives must send and receive the ``[s, b, h]``
    activations themselves, not transposed copies."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sizes = {16 * 4 * 32, 16 * 4 * 32 // 2}
    copies = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(str(func).startswith(name) for name in _COPIES) and args and args[-1].numel() in sizes:
                copies.append((str(func), tuple(args[-1].shape)))
            return func(*args, **(kwargs or {}))

    model_parallel_seed(3, state.current_mesh().tp.rank)
    model = build_model(_config(), VOCAB, 1, sequence_parallel=sequence_parallel)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    with Copies():
        model(tokens, labels=tokens).mean().backward()
    return copies


def _body(rank, world_size):
    from domino.parallel.collectives import (
        gather_from_sequence_region, reduce_scatter_to_sequence_region, scatter_to_sequence_region,
    )

    tp = state.initialize_model_parallel(2).tp
    results = {setting: _train(*setting) for setting in SETTINGS}
    results["dropout"] = _train(2, True, False, dropout=0.1)[0]
    results["overlap"] = {chunks: _overlap_logs(chunks) for chunks in (1, 2)}
    results["copies"] = {sp: _activation_copies(sp) for sp in (False, True)}
    # Adjoints: <gather(x), y> summed over ranks == <x, reduce_scatter(y)>; scatter keeps this rank's half.
    torch.manual_seed(rank)
    x = torch.randn(4, 2, 3, requires_grad=True)
    y = torch.randn(8, 2, 3)
    (gather_from_sequence_region(x, tp) * y).sum().backward()
    full = torch.arange(8 * 2 * 3, dtype=torch.float32).view(8, 2, 3)
    results["adjoint"] = (x.grad, reduce_scatter_to_sequence_region(y, tp), y, scatter_to_sequence_region(full, tp))
    return results


@pytest.fixture(scope="module")
def tp2():
    return run_distributed(_body, 2)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("recompute", [False, True])
def test_sequence_parallel_equals_tensor_parallel(tp2, chunks, recompute):
    for rank, results in enumerate(tp2):
        losses, grads, _ = results[(chunks, True, recompute)]
        base_losses, base_grads, _ = results[(chunks, False, False)]
        assert losses == pytest.approx(base_losses, rel=REL), f"rank {rank}"
        for name, grad in base_grads.items():
            scale = grad.abs().max().clamp_min(1e-12)
            assert (grads[name] - grad).abs().max() <= REL * scale, f"rank {rank}: gradient of {name}"


def test_sequence_parallel_keeps_less_per_rank_and_trains_with_dropout(tp2):
    """Per rank the forward keeps what Korthikanti's formula saves (the estimate's difference, 36,864 bytes here;
    measured 38,144): norm inputs, outputs and masks by the TP size, the norm outputs' slices kept for backward."""
    from domino.config import DominoConfig
    from domino.config.estimate import Layout, estimate_layout

    config = DominoConfig(model=_config())
    plain, sp = (estimate_layout(config, Layout(2, 1, 0, 4, sequence_parallel=on), vocab=VOCAB, device="cpu")
                 for on in (False, True))
    saved = plain.activations - sp.activations
    for results in tp2:
        for chunks in (1, 2):
            measured = results[(chunks, False, False)][2] - results[(chunks, True, False)][2]
            assert measured == pytest.approx(saved, rel=0.1), chunks
        losses = results["dropout"]
        assert all(torch.isfinite(torch.tensor(losses))) and losses != results[(2, True, False)][0]
    assert tp2[0]["dropout"] == tp2[1]["dropout"]  # the loss is reduced over the TP ranks: both see it


def test_sequence_collectives_are_adjoint(tp2):
    x_grads, reduced, ys, scattered = zip(*(r["adjoint"] for r in tp2))
    y_sum = ys[0] + ys[1]
    for rank in range(2):  # d/dx_r sum_k <gather(x), y_k> = slice r of sum_k y_k = reduce_scatter(y)_r
        assert torch.allclose(x_grads[rank], y_sum[4 * rank:4 * rank + 4])
        assert torch.allclose(reduced[rank], y_sum[4 * rank:4 * rank + 4])
        full = torch.arange(8 * 2 * 3, dtype=torch.float32).view(8, 2, 3)
        assert torch.equal(scattered[rank], full[4 * rank:4 * rank + 4])


def test_sequence_collectives_send_the_activations_themselves(tp2):
    """In the sequence-first ``[s, b, h]`` layout every sequence collective's buffer is an activation or a
    contiguous block of one: a training step with sequence parallelism copies no more activations than one
    without, except the embedding slice's clone (which lets the whole-sequence embeddings be freed, as Megatron's
    clone_scatter_output_in_embedding). Batch-first, each all-gather's and reduce-scatter's buffer was a
    transposed copy (37 activation copies in this step instead of 1)."""
    for rank, results in enumerate(tp2):
        plain, sp = results["copies"][False], results["copies"][True]
        assert sorted(sp) == sorted(plain + [("aten.clone.default", (8, 4, 32))]), f"rank {rank}: {sp} vs {plain}"


@pytest.mark.parametrize("chunks", [1, 2])
def test_backward_reduce_scatters_run_behind_the_weight_gradients(tp2, chunks):
    """Each column-parallel input gradient's reduce-scatter is launched by the linear's backward and waited for by
    the gather's: the weight-gradient GEMM (and with 2 chunks the other chunk's backward) runs in between, as in
    Megatron's LinearWithGradAccumulationAndAsyncCommunication. One launch per linear: none fell back to a
    synchronous reduce-scatter."""
    for rank, results in enumerate(tp2):
        between = _ops_between_launch_and_wait(results["overlap"][chunks]["backward"], "reduce-scatter")
        assert len(between) == 2 * 2 * chunks, f"rank {rank}: 2 layers x (QKV, fc1) x {chunks} chunks"
        assert min(between) >= 1, f"rank {rank}: ops between launch and wait {between}"
        if chunks == 2:
            assert max(between) >= 4, f"rank {rank}: the other chunk's backward runs in between: {between}"


@pytest.mark.parametrize("chunks", [1, 2])
def test_backward_gathers_of_the_kept_slices_run_behind_the_input_gradients(tp2, chunks):
    """The column-parallel linears keep their input's sequence slice; backward launches its all-gather first and
    waits for it only after the input-gradient GEMM(s), as Megatron's column-parallel backward does."""
    for rank, results in enumerate(tp2):
        between = _ops_between_launch_and_wait(results["overlap"][chunks]["backward"], "all-gather")
        assert len(between) == 2 * 2 * chunks, f"rank {rank}: 2 layers x (QKV, fc1) x {chunks} chunks"
        assert min(between) >= 1, f"rank {rank}: ops between launch and wait {between}"


def test_forward_all_gathers_run_behind_the_other_chunks_step(tp2):
    """With 2 chunks each norm output's all-gather is launched at the norm and waited for right before the linear,
    after a step of the other chunk, which computes; only the very first (layer 0, chunk 0) has nothing but the
    other chunk's norm before it. With 1 chunk there is nothing to run in between (the same schedule, waited at
    once)."""
    for rank, results in enumerate(tp2):
        two, one = (_ops_between_launch_and_wait(results["overlap"][c]["forward"], "all-gather") for c in (2, 1))
        assert len(two) == 2 * 2 * 2 and len(one) == 2 * 2, f"rank {rank}: {two}, {one}"
        assert min(two[1:]) >= 1, f"rank {rank}: ops between launch and wait {two}"
        assert max(one) == 0, f"rank {rank}: {one}"


def test_backward_gathers_of_the_row_parallel_gradients_run_behind_the_other_chunk(tp2):
    """The adjoint of each row-parallel reduce-scatter, the all-gather of its slice gradient, is launched by the
    reduce-scatter's backward and waited for on the partial sum: with 2 chunks the other chunk's backward runs in
    between, except for the first launched (the last layer of the chunk that finished last). With 1 chunk there is
    nothing in between."""
    for rank, results in enumerate(tp2):
        two, one = (_ops_between_launch_and_wait(results["overlap"][c]["backward"], "output-grad all-gather")
                    for c in (2, 1))
        assert len(two) == 2 * 2 * 2 and len(one) == 2 * 2, f"rank {rank}: {two}, {one}"
        assert min(two[1:]) >= 1, f"rank {rank}: ops between launch and wait {two}"
