"""``--overlap-grad-reduce`` under pipeline stages: the data-parallel mean launched bucket by bucket from the
schedule's backward (:mod:`domino.pipeline.grad_overlap`) gives the gradients of the mean after the schedule.

PP 2 x DP 2 on four gloo ranks, the tiny tied-embedding model of ``test_pipeline_equivalence.py``, different
batches per replica, 1F1B and interleaved 1F1B: the same arithmetic in the same order, so bit-equal. The control
arms the buckets one micro-batch early (a bucket reduced before its last micro-batch's gradient): it must differ.
"""

from __future__ import annotations

import pytest
import torch

from distributed_helpers import run_distributed
from domino.model import GPTModel
from domino.pipeline.grad_overlap import OverlappedGradReduce
from domino.pipeline.gradients import sync_tied_embeddings, tied_embedding_weight
from domino.pipeline.schedule import StageSchedule
from domino.pipeline.stages import split_model
from domino.runtime import state
from domino.train.pipeline_step import average_over_data_parallel
from pipeline.test_pipeline_equivalence import MICRO, MICROBATCHES, SEQ, VOCAB, _config

#: Elements per bucket: small enough that each stage has several buckets.
BUCKET = 3000


def _batch(dp_rank: int):
    g = torch.Generator().manual_seed(100 + dp_rank)
    b = MICRO * MICROBATCHES
    tokens, labels = (torch.randint(0, VOCAB, (b, SEQ), generator=g) for _ in range(2))
    return tokens, labels, (torch.rand(b, SEQ, generator=g) > 0.2).float()


def _grads(full_sd, virtual, overlap_count):
    """This rank's gradients after one step: reduced after the schedule (``overlap_count`` None), or by the
    buckets armed for ``overlap_count`` micro-batches; and how many buckets the backward launched."""
    mesh = state.current_mesh()
    model = GPTModel(_config(), VOCAB)
    model.load_state_dict(full_sd)
    model = split_model(model, mesh.pp.rank, mesh.pp.size, virtual)
    schedule = StageSchedule(model, mesh.pp, num_microbatches=MICROBATCHES, micro_batch_size=MICRO, seq_length=SEQ,
                             hidden_size=32, scale_grads=overlap_count is None)
    tokens, labels, loss_mask = _batch(mesh.dp.rank)
    tied = tied_embedding_weight(model, mesh)
    if overlap_count is None:
        loss = schedule.train_step(tokens, labels, loss_mask)
        sync_tied_embeddings(model, mesh)
        average_over_data_parallel([p.grad for p in model.parameters() if p.grad is not None], mesh)
        return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, 0, 0
    overlap = OverlappedGradReduce(list(model.parameters()), mesh.dp, exclude=tied, bucket_elements=BUCKET)
    overlap.begin(overlap_count)
    loss = schedule.train_step(tokens, labels, loss_mask)
    early = len(overlap._launched)  # launched from the backward's hooks, before finish
    overlap.finish()
    sync_tied_embeddings(model, mesh)
    average_over_data_parallel([tied.grad] if tied is not None else [], mesh)
    overlap.remove()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, early, len(overlap.buckets)


def _body(rank, world_size, full_sd):
    state.initialize_model_parallel(1, pipeline_model_parallel_size=2)
    assert state.get_data_parallel_world_size() == 2
    return {(virtual, count): _grads(full_sd, virtual, count)
            for virtual in (1, 2) for count in (None, MICROBATCHES, MICROBATCHES - 1)}


@pytest.fixture(scope="module")
def per_rank():
    torch.manual_seed(7)
    full_sd = {k: v.clone() for k, v in GPTModel(_config(), VOCAB).state_dict().items()}
    return run_distributed(_body, 4, full_sd)


@pytest.mark.parametrize("virtual", [1, 2])
def test_overlapped_reduce_is_bit_equal_to_the_reduce_after_the_schedule(per_rank, virtual):
    for rank, result in enumerate(per_rank):
        loss, grads, _, _ = result[(virtual, None)]
        o_loss, o_grads, early, buckets = result[(virtual, MICROBATCHES)]
        assert buckets >= 3, f"rank {rank}: {buckets} buckets; the test needs several"
        assert early == buckets, f"rank {rank}: {early} of {buckets} buckets launched from the backward"
        assert torch.equal(o_loss, loss)
        assert grads.keys() == o_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(o_grads[name], grad), f"rank {rank} {name}: {(o_grads[name] - grad).abs().max()}"
    # the replicas hold the mean: equal over the DP pair of each stage (ranks 0, 1 are stage 0's replicas)
    for a, b in ((0, 1), (2, 3)):
        for name, grad in per_rank[a][(virtual, MICROBATCHES)][1].items():
            assert torch.equal(grad, per_rank[b][(virtual, MICROBATCHES)][1][name])


@pytest.mark.parametrize("virtual", [1, 2])
def test_a_bucket_reduced_before_its_last_micro_batch_differs(per_rank, virtual):
    for rank, result in enumerate(per_rank):
        grads = result[(virtual, None)][1]
        early = result[(virtual, MICROBATCHES - 1)][1]
        worst = max(float((early[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads.items())
        assert worst > 1e-3, f"rank {rank}: the early reduction matched within {worst:.2e}"


@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "256"]],
                         ids=["fp32", "bf16", "fp16"])
def test_pretrain_with_overlap_grad_reduce_trains_as_without(tmp_path, precision):
    """`domino pretrain` PP 2 x DP 2 under ZeRO-1 (``PipelineStep``'s wiring; bf16: the buckets are DeepSpeed's
    fp32 gradient buffers): the same losses and norms, bit for bit, with and without the flag. fp16 runs in gloo
    ranks with DeepSpeed's CPU fp16 gate opened (``test_pipeline_fp16``'s module docstring: the gate is closed on
    CPUs without AVX-512 FP16, where torch still runs fp16)."""
    from pipeline_runs import run_records
    from test_pipeline_fp16 import fp16_records

    common = ["--train-iters", "3", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
              "--zero-stage", "1", *precision]
    run = fp16_records if "--fp16" in precision else run_records
    reference = run(tmp_path, "without", 4, common)
    records = run(tmp_path, "with", 4, [*common, "--overlap-grad-reduce"])
    train, ref_train = ([r for r in rs if "eval" not in r] for rs in (records, reference))
    assert [r["iteration"] for r in train] == [1, 2, 3]
    for ref, got in zip(ref_train, train):
        assert (got["lm_loss"], got["grad_norm"]) == (ref["lm_loss"], ref["grad_norm"]), got["iteration"]


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_zero_0_stages_reduce_in_the_optimizers_buckets_as_zero_1_after_the_schedule(tmp_path, precision):
    """PP 2 x DP 2 at ZeRO 0: torch's AdamW whose gradient buckets (``domino.optim.grad_buffer``) the schedule's
    backward reduces, one path with the unstaged runs; the same losses and norms, bit for bit, as ZeRO 1
    (DeepSpeed's optimizer, the gradients averaged after the schedule). bf16: domino's fp32 masters and main
    gradients (``domino.optim.mixed_precision``) against DeepSpeed's BF16_Optimizer's fp32 buffers."""
    from pipeline_runs import run_records

    common = ["--train-iters", "3", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2", *precision]
    reference = run_records(tmp_path, "zero1", 4, [*common, "--zero-stage", "1"])
    records = run_records(tmp_path, "zero0", 4, [*common, "--zero-stage", "0"])
    train, ref_train = ([r for r in rs if "eval" not in r] for rs in (records, reference))
    assert [r["iteration"] for r in train] == [1, 2, 3]
    for ref, got in zip(ref_train, train):
        assert (got["lm_loss"], got["grad_norm"]) == (ref["lm_loss"], ref["grad_norm"]), got["iteration"]
