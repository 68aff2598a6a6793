"""Masked loss / accuracy and generation: single-process reference, and TP=2 on real gloo ranks (resharded loads)."""

import math

import pytest
import torch
import torch.nn.functional as F

from distributed_helpers import run_distributed
from domino.eval.generate import generate_ids
from domino.eval.metrics import MetricTotals, evaluate_batches, vocab_parallel_argmax
from domino.eval.runtime import setup_tensor_parallel
from domino.eval.sampling import SamplingConfig
from domino.checkpoint import on_disk as wio
from domino.checkpoint import model_loading
from eval_checkpoints import save_checkpoint, tiny_config, tiny_model

VOCAB = 100
PROMPT = [3, 14, 15, 92]


def _batch(seed=0, b=3, s=12):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=gen)
    mask = (torch.rand(b, s, generator=gen) > 0.3).float()
    return tokens[:, :-1], tokens[:, 1:].contiguous(), mask, None, None


def test_metrics_match_a_direct_computation():
    torch.manual_seed(0)
    model = tiny_model(tiny_config(), VOCAB, seed=3)
    batches = [_batch(0), _batch(1)]
    result = evaluate_batches(model, batches)
    losses, correct, count = [], 0, 0
    for tokens, labels, mask, _, _ in batches:
        with torch.no_grad():
            logits = model(tokens)
        loss = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        losses.append((loss * mask).sum())
        correct += int(((logits.argmax(-1) == labels).float() * mask).sum())
        count += int(mask.sum())
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(float(sum(losses)) / count, rel=1e-6)
    assert result["ppl"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
    assert result["accuracy"] == pytest.approx(correct / count)
    assert math.isnan(MetricTotals().result()["loss"])


def _tp_body(rank, world, ckpt_dirs, batch):
    mesh = setup_tensor_parallel()
    out = {}
    for name, ckpt in ckpt_dirs.items():
        model, _, _ = model_loading.build_model_from_checkpoint(ckpt, mesh.tp, load_tokenizer=False)
        with torch.no_grad():
            logits = model(batch[0])
        out[name] = {"metrics": evaluate_batches(model, [batch]), "argmax": vocab_parallel_argmax(logits, mesh.tp),
                     "greedy": generate_ids(model, PROMPT, 10),
                     "sampled": generate_ids(model, PROMPT, 10, SamplingConfig(temperature=1.5, top_p=0.9), seed=4)}
    return out


def test_tp2_matches_single_process(tmp_path):
    config = tiny_config()
    model = tiny_model(config, VOCAB, seed=3)
    ckpts = {"saved_tp1": str(save_checkpoint(tmp_path / "tp1", model, config, tp=1)),
             "saved_tp2": str(save_checkpoint(tmp_path / "tp2", model, config, tp=2))}
    batch = _batch(5)
    reference = evaluate_batches(model, [batch])
    with torch.no_grad():
        ref_argmax = model(batch[0]).argmax(-1)
    # Single process, checkpoint saved at TP=2: merged on load.
    merged, _, _ = model_loading.build_model_from_checkpoint(ckpts["saved_tp2"], load_tokenizer=False)
    assert evaluate_batches(merged, [batch]) == reference
    for rank_result in run_distributed(_tp_body, 2, ckpts, batch):
        for name, got in rank_result.items():
            assert got["metrics"]["tokens"] == reference["tokens"], name
            assert got["metrics"]["loss"] == pytest.approx(reference["loss"], rel=1e-5), name
            assert got["metrics"]["accuracy"] == pytest.approx(reference["accuracy"]), name
            assert torch.equal(got["argmax"], ref_argmax), name
            assert got["greedy"] == generate_ids(model, PROMPT, 10), name  # TP generation = one process
            assert got["sampled"] == generate_ids(model, PROMPT, 10, SamplingConfig(temperature=1.5, top_p=0.9),
                                                  seed=4), name
