"""End to end: the whole pipeline under kfp.local, twice, on a small built-in corpus.

Both runs use the quick profile (``domino pipeline run --quick``: the tiny preset) on a small corpus, with
a 512-token BPE trained by the pipeline's train-tokenizer step. Run 1 trains with TP=2 and Domino chunks=2
across two local replicas (the launcher's local backend, one process per replica) and is promoted
(nothing was promoted before). Run 2 runs its training as a Kubeflow Trainer TrainJob (``job_api=trainjob``)
of two nodes x one process, each node a process with the Trainer torch plugin's environment, warm-starts
from the promoted checkpoint, and the gate decides by re-evaluating the promoted model on the same test
samples, on the dataset run 1 made (same corpus and tokenizer: reused, not tokenised again). Everything
goes through the real components, the real launcher and the real training loop.
"""

import json
import math
import os

import pytest

from pipelines.local_run import QUICK_PARAMS, run_local

PARAMS = {
    **QUICK_PARAMS, "corpus": "shakespeare-small", "tokenizer_vocab_size": 512, "train_iters": 6, "micro_batch_size": 4, "eval_interval": 3, "eval_iters": 1,
    "log_interval": 2, "eval_batches": 2, "sample_tokens": 4, "tensor_model_parallel_size": 2, "nproc_per_node": 2,
    "domino_chunks": 2,
}


@pytest.mark.timeout(420)
def test_two_local_runs_promote_then_warm_start_and_gate(tmp_path):
    out = tmp_path / "demo"
    first = run_local(str(out), PARAMS, log=lambda _: None)

    # Run 1: trained, evaluated, reported, promoted.
    assert first.promoted and first.test["promote"] and first.test["incumbent_ppl"] is None
    assert first.train["iterations"] == 6 and first.train["tokens_seen"] > 0
    assert math.isfinite(first.train["final_train_loss"]) and first.test["test_ppl"] > 1.0
    assert 0.0 <= first.test["token_accuracy"] <= 1.0
    checkpoint = os.path.join(first.checkpoint_dir, open(os.path.join(first.checkpoint_dir, "latest")).read().strip())
    meta = json.load(open(os.path.join(checkpoint, "checkpoint.json")))
    assert meta["tensor_model_parallel_size"] == 2 and meta["iteration"] == 6
    assert meta["tokenizer"].endswith(os.path.join("data", "tokenizer")) and meta["padded_vocab_size"] == 512
    report = open(first.report, encoding="utf-8").read()
    assert "<img" in report and "perplexity" in report and first.run_id in report and ">None<" not in report
    assert first.test["unigram_ppl"] > 1.0 and 0.0 <= first.test["sample_word_fraction"] <= 1.0
    verdict = first.verdict()
    assert "unigram model of the same tokenizer" in verdict[0]
    assert verdict[1].startswith(f"continue: domino generate --load {first.checkpoint_dir} --prompt")
    assert first.checkpoint_dir.startswith(str(out)) and first.report.startswith(str(out))
    assert first.dataset["reused"] is False and first.dataset["groups_tokenized"] == 1
    registry = json.load(open(out / "shared" / "promoted.json"))
    assert registry["current"]["run_id"] == first.run_id
    assert registry["current"]["test_ppl"] == pytest.approx(first.test["test_ppl"])

    # Run 2: warm start from the promoted model, then the gate compares on the same test samples.
    second = run_local(str(out), {**PARAMS, "warm_start": True, "job_api": "trainjob", "nodes": 2,
                                  "nproc_per_node": 1}, log=lambda _: None)
    assert second.run_id != first.run_id
    # Trained as a TrainJob: its second node ran as the node Job's pod of index 1, TP=2 across the nodes.
    assert (out / "shared" / "logs" / f"{second.train['job']}-node-0-1.log").exists()
    assert second.train["world_size"] == 2 and second.train["iterations"] == 6
    # Same corpus and tokenizer: the second run reuses the first run's dataset instead of tokenising again.
    assert second.dataset["reused"] is True and second.dataset["groups_tokenized"] == 0
    assert second.dataset["prefix"] == first.dataset["prefix"]
    assert second.train["warm_start_from"] == first.checkpoint_dir
    assert second.test["incumbent_run"] == first.run_id
    # The promoted checkpoint, re-evaluated on the same data and samples, gives its recorded perplexity.
    assert second.test["incumbent_ppl"] == pytest.approx(first.test["test_ppl"], rel=1e-5)
    better = second.test["test_ppl"] < second.test["incumbent_ppl"]
    assert second.test["promote"] is better and second.promoted is better
    registry = json.load(open(out / "shared" / "promoted.json"))
    assert registry["current"]["run_id"] == (second.run_id if better else first.run_id)
    assert len(registry["history"]) == (2 if better else 1)
    summary = json.load(open(out / "summary.json"))
    assert summary["run_id"] == second.run_id
