"""Context parallelism trains as the unsplit run does: GPT and LLaMA (GQA), composed with TP, Domino, sequence
parallelism, ZeRO and recompute, and its checkpoints resume at another CP size."""

from __future__ import annotations

import re

import pytest

from train_helpers import TINY, read_metrics, run_pretrain
from domino.checkpoint import model_shards, on_disk
from domino.config import ConfigError
from domino.config.flags import parse_config
from domino.config.validate import validate

STEPS = ["--train-iters", "3", "--eval-iters", "0", "--eval-interval", "0", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr-warmup-iters", "0", "--lr-decay-iters", "8", "--adam-eps", "1e-4"]
LLAMA = ["--preset", "tiny-llama", "--log-interval", "1", "--num-workers", "0", "--seed", "7"]
SAME_VOCAB_AT_TP2 = ["--make-vocab-size-divisible-by", "64"]


def _run(tmp_path, corpus_prefix, name, nproc, args, after=()):
    out = tmp_path / name
    run_pretrain([*args, *STEPS, *after, "--data-path", corpus_prefix, "--save", str(out / "ckpt"),
                  "--metrics-file", str(out / "metrics.jsonl")], nproc=nproc)
    weights = model_shards.load_full_state_dict(on_disk.resolve_checkpoint_dir(out / "ckpt"))
    return _steps(out / "metrics.jsonl"), weights


def _steps(path):
    """``{iteration: (loss, gradient norm)}`` of a run's training records."""
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in read_metrics(path) if "eval" not in r}


def _assert_same_run(reference, other, weight_rtol=1e-5):
    """Losses and gradient norms within 1e-5 relative at every step, every weight after the three steps within
    ``weight_rtol`` of its tensor's largest entry. The reference runs the same ZeRO stage: ZeRO 2's optimizer differs
    from stage 0's by more than that after a step (gradient norm 1.58849 vs 1.58821 at step 2, on one process)."""
    (ref_steps, ref_weights), (steps, weights) = reference, other
    assert ref_steps.keys() == steps.keys() == {1, 2, 3}
    for step in ref_steps:
        for got, want in zip(steps[step], ref_steps[step]):
            assert abs(got - want) <= 1e-5 * abs(want), (step, steps, ref_steps)
    assert ref_weights.keys() == weights.keys()
    for key in ref_weights:
        error = (weights[key] - ref_weights[key]).abs().max().item()
        assert error <= weight_rtol * ref_weights[key].abs().max().item(), (key, error)


def test_gpt_cp2_zero2_trains_as_cp1_and_resumes_at_cp1_and_cp2(tmp_path, corpus_prefix):
    """Losses and weights after three steps equal (learned positions: each chunk keeps its true positions; ZeRO 2
    shards over the two CP ranks, which hold one replica); the CP 2 checkpoint then resumes at CP 1 and at CP 2 and
    their fourth step is the unsplit run's; validation at CP 2 gives CP 1's loss."""
    evaluated = ["--eval-interval", "3", "--eval-iters", "2"]
    reference = _run(tmp_path, corpus_prefix, "cp1", 1, [*TINY, "--zero-stage", "2"], evaluated)
    cp2 = _run(tmp_path, corpus_prefix, "cp2", 2, [*TINY, "--context-parallel-size", "2", "--zero-stage", "2"],
               evaluated)
    _assert_same_run(reference, cp2)
    validation = [[r["lm_loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if r.get("eval") == "valid"]
                  for name in ("cp1", "cp2")]
    assert len(validation[0]) == 1 and validation[1] == pytest.approx(validation[0], rel=1e-5)

    def fourth_step(name, load, cp=1):
        out = tmp_path / name
        run_pretrain([*TINY, *STEPS, "--train-iters", "4", "--zero-stage", "2", "--data-path", corpus_prefix,
                      "--load", str(load), "--metrics-file", str(out / "metrics.jsonl"),
                      "--context-parallel-size", str(cp)], nproc=cp)
        return _steps(out / "metrics.jsonl")[4][0]

    unsplit = fourth_step("cp1-resumed", tmp_path / "cp1" / "ckpt")
    assert fourth_step("cp2-at-cp1", tmp_path / "cp2" / "ckpt") == pytest.approx(unsplit, rel=1e-5)
    # On its own layout, each CP rank takes back its own ZeRO partition (sharded over the two CP ranks).
    assert fourth_step("cp2-at-cp2", tmp_path / "cp2" / "ckpt", cp=2) == pytest.approx(unsplit, rel=1e-5)


def test_llama_gqa_cp2_tp2_domino_sp_zero1_recompute_trains_as_one_process(tmp_path, corpus_prefix):
    """RoPE per chunk, TP 2 with Domino chunks and sequence parallelism, ZeRO 1 sharded over the data x context
    group, full recompute (context-parallel attention runs again in backward); both exchanges: grouped-query keys
    around the ring (p2p), and the all-to-all over heads (a2a: 8 heads, 4 key/value groups, so each TP rank's 4 and
    2 split over CP 2)."""
    model = [*LLAMA, *SAME_VOCAB_AT_TP2, "--num-attention-heads", "8", "--num-query-groups", "4"]
    reference = _run(tmp_path, corpus_prefix, "one", 1, [*model, "--zero-stage", "1"])
    for comm_type in ("p2p", "a2a"):
        composed = _run(tmp_path, corpus_prefix, f"cp2tp2-{comm_type}", 4, [
            *model, "--context-parallel-size", "2", "--cp-comm-type", comm_type, "--tensor-model-parallel-size", "2",
            "--domino-chunks", "2", "--sequence-parallel", "--zero-stage", "1", "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "1"])
        _assert_same_run(reference, composed)


@pytest.mark.parametrize("name, model, comm_types", [
    ("gpt", TINY, ("p2p",)),  # the all-to-all's head split is GQA's case below, the harder one
    ("llama-gqa", [*LLAMA, "--num-attention-heads", "8", "--num-query-groups", "4"], ("p2p", "a2a")),  # a2a: 2
])  # heads, 1 group each
def test_cp4_trains_as_cp1_with_both_exchanges(tmp_path, corpus_prefix, name, model, comm_types):
    """CP 4 on 4 gloo ranks, each holding two of the sequence's eight chunks (64 tokens: 16 per rank): the ring
    passes every key/value block three times (rank r sees blocks both before and after its own: both kinds of
    partial block, not only CP 2's one of each), the all-to-all splits the heads four ways. Losses, gradient norms
    and weights after three steps are the unsplit run's."""
    reference = _run(tmp_path, corpus_prefix, f"{name}-cp1", 1, model)
    for comm_type in comm_types:
        cp4 = _run(tmp_path, corpus_prefix, f"{name}-cp4-{comm_type}", 4, [
            *model, "--context-parallel-size", "4", "--cp-comm-type", comm_type])
        _assert_same_run(reference, cp4)


def test_per_document_masks_at_cp2_train_as_cp1(tmp_path, corpus_prefix):
    """--reset-attention-mask and --reset-position-ids at CP 2: the batch's mask of the whole sequence reaches every
    rank unsplit; the ring's blocks read their parts of it, the all-to-all applies it after the exchange; the
    positions restart per document. Mock data over 32 ids: the end-of-document id (the last) is one token in 32,
    two documents' boundaries a sample. Losses and norms agree within 1.4e-7; Adam's step lifts the noise in the
    smallest tensor, the last MLP's output bias (largest entry 0.008): 8.4e-6 of it with a2a, 1.3e-5 with the ring
    (2e-5 allowed here; a dropped mask moves the losses by far more than 1e-5)."""
    documents = [*TINY, "--reset-attention-mask", "--reset-position-ids", "--mock-data", "--vocab-size", "32"]
    reference = _run(tmp_path, corpus_prefix, "documents-cp1", 1, documents)
    for comm_type in ("p2p", "a2a"):
        cp2 = _run(tmp_path, corpus_prefix, f"documents-{comm_type}", 2, [
            *documents, "--context-parallel-size", "2", "--cp-comm-type", comm_type])
        _assert_same_run(reference, cp2, weight_rtol=2e-5)


@pytest.mark.parametrize("comm_type", ["p2p", "a2a"])
def test_attention_dropout_at_cp2_is_drawn_and_replayed_by_recompute(tmp_path, corpus_prefix, comm_type):
    """Attention dropout at CP 2 (the ring's blocks, or the all-to-all's head group, from the TP stream, seeded per
    CP rank): the masks change the run (against dropout 0) and full recompute draws them again exactly (losses,
    norms and weights as without recompute; the ring's backward draws them a third time)."""
    cp2 = [*TINY, "--context-parallel-size", "2", "--cp-comm-type", comm_type, "--hidden-dropout", "0"]
    dropped = [*cp2, "--attention-dropout", "0.2"]
    plain = _run(tmp_path, corpus_prefix, "dropped", 2, dropped)
    recomputed = _run(tmp_path, corpus_prefix, "dropped-recomputed", 2, [
        *dropped, "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    _assert_same_run(plain, recomputed)
    undropped, _ = _run(tmp_path, corpus_prefix, "undropped", 2, [*cp2, "--attention-dropout", "0"])
    # At initialisation the loss barely moves (near-uniform attention); the first gradient norm does (0.3 %).
    assert abs(plain[0][1][1] - undropped[1][1]) > 1e-3 * undropped[1][1], (plain[0], undropped)


def test_pipeline_stages_with_cp2_train_as_one_process(tmp_path, corpus_prefix):
    """PP 2 x CP 2 (1F1B, ZeRO 1, the DP x CP reduction overlapped with the backward): the middle of the pipeline
    passes each rank's chunks on, the last stage's loss is a CP share, and the stages' gradients are summed over CP
    with their DP mean, which ZeRO 1 takes into its partitions without reducing again. The reference is PP 2 at CP 1: its ZeRO 1 step is the pipeline's (it matches
    one process at ZeRO 0, not at ZeRO 1: the gradient norm of step 2 reads 1.58821 vs 1.58849)."""
    pipelined = [*TINY, "--zero-stage", "1", "--pipeline-model-parallel-size", "2", "--overlap-grad-reduce"]
    reference = _run(tmp_path, corpus_prefix, "pp2", 2, pipelined)
    staged = _run(tmp_path, corpus_prefix, "pp2cp2", 4, [*pipelined, "--context-parallel-size", "2"])
    _assert_same_run(reference, staged)


def test_interleaved_stages_with_cp2_in_bf16_track_the_unstaged_bf16_run(tmp_path, corpus_prefix):
    """Interleaved PP 2 x 2 chunks x CP 2 in bf16 (the BF16_Optimizer's fp32 buffers summed over CP)."""
    bf16 = [*LLAMA, "--bf16", "--num-layers", "4"]
    reference, _ = _run(tmp_path, corpus_prefix, "bf16-one", 1, bf16, ["--train-iters", "2"])
    staged, _ = _run(tmp_path, corpus_prefix, "bf16-pp2cp2", 4, [
        *bf16, "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--virtual-pipeline-model-parallel-size", "2"], ["--train-iters", "2"])
    assert reference.keys() == staged.keys() == {1, 2}
    for step in reference:
        assert staged[step][0] == pytest.approx(reference[step][0], rel=2e-3), (staged, reference)


@pytest.mark.parametrize("flags,message", [
    (["--context-parallel-size", "3"], "--seq-length 64 is not divisible by 2 x --context-parallel-size 3"),
    (["--cp-comm-type", "allgather"], "--cp-comm-type allgather: must be one of p2p, a2a"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--num-attention-heads", "2"],
     "--cp-comm-type a2a with --context-parallel-size 2: the 1 query and 1 key/value heads of each TP rank"),
    (["--context-parallel-size", "4"], "world size 4 is not divisible by"),
])
def test_layouts_context_parallelism_cannot_run_are_refused_before_work(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(parse_config([*TINY, "--mock-data", "--tensor-model-parallel-size", "2", *flags]), world_size=4)


def test_bf16_cp2_tracks_bf16_cp1(tmp_path, corpus_prefix):
    """bf16 weights and activations around the ring (the blocks merge in fp32): the losses of two steps stay
    within bf16's rounding of the unsplit bf16 run's."""
    bf16 = [*LLAMA, "--bf16", "--train-iters", "2"]
    reference, _ = _run(tmp_path, corpus_prefix, "bf16-cp1", 1, bf16, ["--train-iters", "2"])
    cp2, _ = _run(tmp_path, corpus_prefix, "bf16-cp2", 2, [*bf16, "--context-parallel-size", "2"],
                  ["--train-iters", "2"])
    assert reference.keys() == cp2.keys() == {1, 2}
    for step in reference:
        assert cp2[step][0] == pytest.approx(reference[step][0], rel=2e-3), (cp2, reference)
