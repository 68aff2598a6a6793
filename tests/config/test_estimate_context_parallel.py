"""`domino estimate` knows context parallelism: a rank's activations are its seq / CP tokens', the FLOPs the
whole sequence's, and the layout search tries CP where the run allows it."""

from __future__ import annotations

import dataclasses

import pytest

from domino.config.estimate import candidate_layouts, describe, estimate_layout, layout_of
from domino.config.flags import parse_config

LONG = ["--preset", "gpt3-1.3b", "--seq-length", "32768", "--max-position-embeddings", "32768",
        "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16"]


def _at(config, tp, cp):
    layout = dataclasses.replace(layout_of(config, tp * cp), tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 data_parallel_size=1)
    return estimate_layout(config, layout, gpu_memory_gb=80, peak_tflops=989)


def test_activations_and_logits_split_over_cp_and_the_work_does_not():
    config = parse_config(LONG)
    one, two = _at(config, 8, 1), _at(config, 8, 2)
    assert two.activations == pytest.approx(one.activations / 2, rel=1e-6)
    assert two.logits == pytest.approx(one.logits / 2, rel=1e-6)
    assert (two.weights, two.optimizer) == (one.weights, one.optimizer)  # CP shards activations, not weights
    assert two.flops_per_token == one.flops_per_token
    assert two.timing.compute_s == pytest.approx(one.timing.compute_s / 2)  # twice the GPUs on the same tokens
    assert "TP 8 x CP 2 x DP 1" in describe(two)


def test_the_search_tries_cp_only_where_the_run_allows_it():
    allowed = {lay.context_parallel_size for lay in candidate_layouts(parse_config(LONG), 16)}
    assert allowed == {1, 2, 4, 8}
    short = parse_config([*LONG, "--seq-length", "20"])  # 2 x CP equal chunks: 20 = 4 x 5
    assert {lay.context_parallel_size for lay in candidate_layouts(short, 16)} == {1, 2}


def test_the_bytes_each_exchange_sends_per_step():
    """GPT 1.3B (MHA, h 2048) at TP 8 x CP 2, 16,384 local tokens, bf16, 24 layers x 64 micro-batches per step.
    A rank's key/value block is 16384 x 2 x 2048 / 8 = 8,388,608 values: the ring sends one forward, one backward
    and two fp32 gradient blocks home (12 bytes per value); the all-to-all half of q, k, v and the output each way
    (16384 x 4096 / 8 x 2 x 0.5 values of 2 bytes, twice)."""
    block = 16384 * 2 * 2048 // 8
    per_step = 24 * 64
    ring = _at(parse_config(LONG), 8, 2)
    a2a = _at(parse_config([*LONG, "--cp-comm-type", "a2a"]), 8, 2)
    assert ring.cp_bytes_per_step == per_step * 12 * block
    assert a2a.cp_bytes_per_step == per_step * 2 * (16384 * 4096 * 2 // 8 // 2) * 2
    assert _at(parse_config(LONG), 8, 1).cp_bytes_per_step == 0
    recomputed = _at(parse_config([*LONG, "--recompute-granularity", "full", "--recompute-method", "uniform",
                                   "--recompute-num-layers", "1"]), 8, 2)
    assert recomputed.cp_bytes_per_step == per_step * 14 * block  # the forward's block once more
    assert a2a.to_json()["context_parallel_gb_per_step"] == round(a2a.cp_bytes_per_step / 2**30, 4)


def test_the_ring_counts_its_buffers_and_no_scores_on_gpus_dropout_included():
    """On GPUs the ring's blocks run a fused kernel (the kernel table's ``ring_blocks_fused``, with dropout too:
    ``ring_blocks_fuse_dropout``): backward holds the key/value blocks (held and arriving, bf16), the fp32 query
    gradient, the two fp32 key/value gradients (in flight and arriving) and the block's ``dq, dk, dv`` (bf16), and
    no ``[b, H/t, s, s]`` scores (s = 16,384 local tokens, 2 heads per TP rank; no GQA); with attention dropout the
    same. The peak holds the larger of that and the logits, which are freed before the first attention backward
    runs."""
    est = _at(parse_config(LONG), 8, 2)
    s, heads, d = 16384, 2, 128  # 16 heads of 128 over TP 8
    query, kv = heads * s * d, 2 * heads * s * d
    assert est.attention == 2 * kv * 2 + 4 * query + 8 * kv + 3 * query * 2
    dropped = _at(parse_config([*LONG, "--attention-dropout", "0.1"]), 8, 2)
    assert dropped.attention == est.attention
    assert est.total - dataclasses.replace(est, attention=0.0).total == max(0.0, est.attention - est.logits)
    assert _at(parse_config(LONG), 8, 1).attention == 0  # CP 1: SDPA's own kernels, what they save counted


def test_the_fused_cpu_blocks_and_the_all_to_all_hold_no_scores():
    """On CPU without attention dropout the ring's blocks are the fused kernel: the buffers only, linear in the
    tokens; the all-to-all holds its exchange buffers (q, k, v sent and received, and the output's), and with
    attention dropout on CPU (the math path) the scores of the whole sequence, for 1 / CP of the heads."""
    from domino.config.estimate import Layout, estimate_layout

    def attention(comm, seq, dropout=0.0, cp=2):
        config = parse_config(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                               "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--cp-comm-type",
                               comm, "--attention-dropout", str(dropout)])
        layout = Layout(micro_batch_size=2, zero_stage=0, context_parallel_size=cp)
        return estimate_layout(config, layout, device="cpu").attention

    assert attention("p2p", 2048) == 2 * attention("p2p", 1024)
    query = 2 * 4 * 512 * 16 * 4  # b H s d fp32 at 512 local tokens
    assert attention("a2a", 1024) == 2 * (3 * query) + 2 * query
    assert attention("a2a", 1024, 0.1) == 2 * (3 * query) + 4 * 2 * (4 / 2) * 1024 ** 2
    assert attention("p2p", 1024, 0.1) > 4 * attention("p2p", 1024)  # the math blocks' scores


def test_the_estimates_kernel_choice_is_the_kernel_tables():
    from domino.config.memory_formulas import RING_BLOCKS_FUSE_DROPOUT, RING_BLOCKS_FUSED
    from domino.parallel.kernels import CPU_KERNELS, CUDA_KERNELS
    assert RING_BLOCKS_FUSED == {"cpu": CPU_KERNELS.ring_blocks_fused, "gpu": CUDA_KERNELS.ring_blocks_fused}
    assert RING_BLOCKS_FUSE_DROPOUT == {"cpu": CPU_KERNELS.ring_blocks_fuse_dropout,
                                        "gpu": CUDA_KERNELS.ring_blocks_fuse_dropout}


def test_validation_names_what_was_measured_of_context_parallelism():
    from domino.config.deepspeed_memory import VALIDATION
    assert "context parallelism at CP 2 and 4" in VALIDATION["validated"]
    assert "not counted" not in VALIDATION["not_validated"].split("context parallelism")[-1].split("(")[0]
