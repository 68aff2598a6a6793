"""``DOMINO_KERNELS=compiled`` at TP=2: each layer's attention and MLP-output steps run as compiled segments
(:mod:`domino.model.segments`, real inductor on CPU) and compute what the eager layers compute, under synchronous
TP, Domino and sequence parallelism, for GPT and for LLaMA's pieces (RoPE, SwiGLU, RMSNorm, GQA); attention dropout
inside a segment draws from the TP stream, as eager attention does; at CP=2 no block is compiled whole.

Two real gloo ranks; each compares its compiled model with its eager one on the same shards and batch (the TP=2
eager layouts are checked against TP=1 in ``test_model_tp_domino_equivalence.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from distributed_helpers import run_distributed
from domino.parallel import random as tp_random
from domino.parallel.kernels import BLOCK_BACKEND, CPU_KERNELS, apply_kernels
from domino.runtime import state
from model_fixtures import VOCAB, assert_close_rel, build_model, random_batch, tiny_config

COMPILED_CPU = dataclasses.replace(CPU_KERNELS, compile_blocks=BLOCK_BACKEND)
VARIANTS = {
    "gpt": {},
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
                  disable_bias_linear=True, group_query_attention=True, num_query_groups=2, norm_epsilon=1e-6),
}
CHUNKS = (1, 2)


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], labels=batch["labels"])
    (losses * batch["weights"]).sum().backward()
    return losses.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _equality_body(rank, world_size, batch):
    state.initialize_model_parallel(2)
    results = {}
    for name, overrides in VARIANTS.items():
        for chunks in CHUNKS:
            torch.manual_seed(3)
            model = build_model(tiny_config(**overrides), VOCAB, chunks)
            model.train()
            eager = _step(model, batch)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            compiled = [_step(apply_kernels(model, COMPILED_CPU), batch) for _ in range(2)]
            traced = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
            apply_kernels(model, None)
            results[(name, chunks)] = eager, compiled, traced
    # Sequence parallelism: the gathers and reduce-scatters stay outside the graphs, as the other collectives.
    torch.manual_seed(3)
    model = build_model(tiny_config(), VOCAB, 2, sequence_parallel=True)
    eager = _step(model, batch)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = [_step(apply_kernels(model, COMPILED_CPU), batch)]
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    results[("gpt, sequence parallel", 2)] = eager, compiled, traced
    return results


def test_compiled_segments_equal_the_eager_layers_at_tp2():
    results = run_distributed(_equality_body, 2, random_batch(seed=4))
    for rank, per_rank in enumerate(results):
        for (name, chunks), (eager, compiled, traced) in per_rank.items():
            label = f"rank {rank} {name} chunks={chunks}"
            if chunks == 1:  # the attention and MLP-output graphs (Domino's chunks may reuse them)
                assert traced >= 2, f"{label}: {traced} graphs compiled"
            for losses, grads in compiled:  # the first call compiles; the second runs the cached graphs
                assert_close_rel(losses, eager[0], 1e-5, f"{label} losses")
                assert grads.keys() == eager[1].keys()
                for param, grad in eager[1].items():
                    assert_close_rel(grads[param], grad, 1e-5, f"{label} grad {param}")


def _dropout_body(rank, world_size):
    state.initialize_model_parallel(2)
    tp_random.model_parallel_seed(1234, tp_rank=rank, tp_size=2)
    torch.manual_seed(8)
    model = apply_kernels(build_model(tiny_config(attention_dropout=0.5), VOCAB, 2), COMPILED_CPU)
    model.train()
    batch = random_batch(seed=4)
    default_before = torch.get_rng_state()
    tp_before = tp_random.capture_rng_states()["tracker"]
    losses = model(batch["tokens"], labels=batch["labels"])
    losses.sum().backward()
    tp_after = tp_random.capture_rng_states()["tracker"]
    tp_advanced = any(not torch.equal(tp_before[k], tp_after[k]) for k in tp_before)
    return torch.equal(default_before, torch.get_rng_state()), tp_advanced, bool(torch.isfinite(losses).all())


def test_attention_dropout_in_a_segment_draws_the_tp_stream():
    for rank, (default_kept, tp_advanced, finite) in enumerate(run_distributed(_dropout_body, 2)):
        assert finite, f"rank {rank}: non-finite losses"
        assert default_kept, f"rank {rank}: a compiled segment drew attention dropout from the default generator"
        assert tp_advanced, f"rank {rank}: the TP stream did not advance"


def _context_parallel_body(rank, world_size, batch):
    from domino.model import GPTModel

    mesh = state.initialize_model_parallel(1, context_parallel_size=2)
    torch.manual_seed(3)
    model = GPTModel(tiny_config(), VOCAB, tp=mesh.tp, cp=mesh.cp)
    model.train()
    eager = _step(model, batch)
    compiled = _step(apply_kernels(model, COMPILED_CPU), batch)
    return eager, compiled


def test_context_parallel_blocks_are_not_compiled_whole():
    """At TP=1 and CP=2 a block exchanges keys and values inside attention: no whole-block graph (it failed to
    trace the ring), only step E's segment; each rank's losses and gradients equal its eager ones."""
    for rank, (eager, compiled) in enumerate(run_distributed(_context_parallel_body, 2, random_batch(seed=4))):
        assert_close_rel(compiled[0], eager[0], 1e-5, f"rank {rank} losses")
        for param, grad in eager[1].items():
            assert_close_rel(compiled[1][param], grad, 1e-5, f"rank {rank} grad {param}")
