"""Pipeline parallelism equals the unsplit model: losses and every gradient over a few AdamW steps.

Reference: the whole ``GPTModel`` on one process (TP=1, PP=1), the mean over four micro-batches of each one's
masked mean loss, then a torch AdamW step. The pipelined runs load the same weights, cut the model into stages
(:func:`domino.pipeline.stages.split_model`), run the 1F1B schedule of ``torch.distributed.pipelining``, sum the
tied embeddings' gradient over the first and last stage and take the same AdamW step per stage. Each rank returns
its gradients under its parameters' names, the unsplit model's; tensor-parallel shards are joined back
(``merge_tp_shards``).
fp32, no dropout: equal within float rounding (1e-5 relative on the first step; AdamW's division by the root of
the second moment magnifies rounding in later steps' weights, hence 1e-4 there). Without the tied-embedding sum the
embedding gradients are off by the output layer's whole share.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from distributed_helpers import run_distributed
from domino.checkpoint.sharding import merge_tp_shards, shard_state_dict
from domino.config import ModelConfig
from domino.model import GPTModel
from domino.pipeline.gradients import sync_tied_embeddings
from domino.pipeline.schedule import StageSchedule, masked_mean_loss
from domino.pipeline.stages import model_chunks, split_model
from domino.runtime import state

VOCAB, SEQ, MICRO, MICROBATCHES, STEPS, LR = 64, 8, 2, 4, 3, 1e-2
#: Forward-only micro-batch counts evaluated after training: fewer than the stages (and than the virtual stages).
EVAL_COUNTS = (1, 3)
REL_FIRST, REL_LATER = 1e-5, 1e-4


def _config() -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=SEQ, max_position_embeddings=16,
                       hidden_dropout=0.0, attention_dropout=0.0)


def _batches() -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    b = MICRO * MICROBATCHES
    out = []
    for _ in range(STEPS):
        tokens, labels = (torch.randint(0, VOCAB, (b, SEQ), generator=g) for _ in range(2))
        loss_mask = (torch.rand(b, SEQ, generator=g) > 0.2).float()
        position_ids = torch.arange(SEQ).flip(0).unsqueeze(0).expand(b, SEQ).contiguous()  # not the default
        out.append(dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids))
    return out


def _reference(full_sd, batches):
    model = GPTModel(_config(), VOCAB)
    model.load_state_dict(full_sd)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        per_micro = []
        for m in range(MICROBATCHES):
            rows = slice(m * MICRO, (m + 1) * MICRO)
            out = model(batch["tokens"][rows], batch["position_ids"][rows], labels=batch["labels"][rows])
            per_micro.append(masked_mean_loss(out, batch["loss_mask"][rows]))
        loss = torch.stack(per_micro).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads, _reference_eval(model, batches[0])


@torch.no_grad()
def _reference_eval(model, batch):
    """The mean loss of the first ``count`` micro-batches of ``batch`` for each of :data:`EVAL_COUNTS`."""
    out = []
    for count in EVAL_COUNTS:
        per_micro = [masked_mean_loss(model(batch["tokens"][m * MICRO:(m + 1) * MICRO],
                                            batch["position_ids"][m * MICRO:(m + 1) * MICRO],
                                            labels=batch["labels"][m * MICRO:(m + 1) * MICRO]),
                                      batch["loss_mask"][m * MICRO:(m + 1) * MICRO]) for m in range(count)]
        out.append(torch.stack(per_micro).mean())
    return out


def _pipelined_body(rank, world_size, tp, full_sd, batches, variants, sync):
    from domino.overlap.schedule import apply_domino
    from domino.overlap.sequence_parallel import apply_sequence_parallel

    mesh = state.initialize_model_parallel(tp, pipeline_model_parallel_size=world_size // tp)
    results = {}
    for chunks, sequence_parallel, virtual in variants:
        model = GPTModel(_config(), VOCAB, tp=mesh.tp)
        model.load_state_dict(shard_state_dict(full_sd, state.get_tensor_model_parallel_rank(), tp))
        model = split_model(model, state.get_pipeline_model_parallel_rank(),
                            state.get_pipeline_model_parallel_world_size(), virtual)
        for chunk in model_chunks(model):  # as domino.train.gpt_recipe does
            if sequence_parallel:
                apply_sequence_parallel(chunk)
            apply_domino(chunk, chunks)
        pipeline = StageSchedule(model, mesh.pp, num_microbatches=MICROBATCHES, micro_batch_size=MICRO, seq_length=SEQ,
                                 hidden_size=32, sequence_parallel=sequence_parallel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, grads = [], []
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            losses.append(pipeline.train_step(batch["tokens"], batch["labels"], batch["loss_mask"],
                                              batch["position_ids"]))
            if sync:
                sync_tied_embeddings(model, mesh)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # the whole model's names
            optimizer.step()
        evals = []
        if virtual > 1:  # the chunks' forward-only schedule (1F1B's GPipe one: test_pipeline_training.py)
            model.eval()
            with torch.no_grad():
                evals = [pipeline.eval_step(*(batches[0][k][:count * MICRO]
                                              for k in ("tokens", "labels", "loss_mask", "position_ids")))
                         for count in EVAL_COUNTS]
        results[(chunks, sequence_parallel, virtual)] = (losses, grads, evals)
    return results


def _assert_close(actual, expected, step, what):
    rel = REL_FIRST if step == 0 else REL_LATER
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max()
    assert err <= rel * scale, f"{what}: max error {err:.3e} exceeds {rel:g} x {scale:.3e}"


def _check(per_rank, tp, reference, variant):
    ref_losses, ref_grads, ref_evals = reference
    stages = len(per_rank) // tp
    for rank, result in enumerate(per_rank):
        for step, loss in enumerate(result[variant][0]):
            _assert_close(loss, ref_losses[step], step, f"{variant} rank {rank} step {step} loss")
        assert len(result[variant][2]) == (len(EVAL_COUNTS) if variant[2] > 1 else 0)
        for count, loss, ref in zip(EVAL_COUNTS, result[variant][2], ref_evals):  # after the last update
            _assert_close(loss, ref, STEPS, f"{variant} rank {rank} evaluation of {count} micro-batches")
    for step in range(STEPS):
        merged = {}
        for stage in range(stages):
            shards = [per_rank[stage * tp + t][variant][1][step] for t in range(tp)]
            merged.update(merge_tp_shards(shards))
        # The last stage's output layer is its copy of the tied embeddings: it must carry the same gradient.
        tied = merged.pop("output_layer.weight")
        _assert_close(tied, ref_grads[step]["embedding.word_embeddings.weight"], step,
                      f"{variant} step {step} tied copy")
        assert merged.keys() == ref_grads[step].keys()
        for name, grad in merged.items():
            _assert_close(grad, ref_grads[step][name], step, f"{variant} step {step} grad {name}")


def _run(world_size, tp, variants, sync=True):
    torch.manual_seed(7)
    full_sd = {k: v.clone() for k, v in GPTModel(_config(), VOCAB).state_dict().items()}
    batches = _batches()
    reference = _reference(full_sd, batches)
    per_rank = run_distributed(_pipelined_body, world_size, tp, full_sd, batches, variants, sync)
    return per_rank, reference


def test_four_stages_match_the_unsplit_model():
    """One layer per stage: the middle stages hold neither embeddings nor output layer."""
    per_rank, reference = _run(4, 1, [(1, False, 1)])
    _check(per_rank, 1, reference, (1, False, 1))


def test_two_stages_of_two_interleaved_chunks_match_the_unsplit_model():
    """Interleaved 1F1B: rank 0 holds virtual stages 0 and 2 (the embeddings and layer 2), rank 1 virtual stages 1
    and 3 (layers 1 and 3, the final norm and the tied copy), one layer each; the activations go 0 -> 1 -> 0 -> 1."""
    per_rank, reference = _run(2, 1, [(1, False, 2)])
    assert sorted(per_rank[0][(1, False, 2)][1][0]) == sorted(
        ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
         *(n for n in reference[1][0] if n.startswith(("layers.0.", "layers.2.")))])
    _check(per_rank, 1, reference, (1, False, 2))


def test_two_stages_with_tp2_domino_and_sequence_parallel_match_the_unsplit_model():
    """1F1B with Domino's chunks, with and without sequence parallelism, and the interleaved schedule with both."""
    variants = [(2, False, 1), (2, True, 1), (2, True, 2)]
    per_rank, reference = _run(4, 2, variants)
    for variant in variants:
        _check(per_rank, 2, reference, variant)
