"""End-to-end `domino pretrain` runs on the built-in corpus: losses fall in every parallel layout."""

import pytest

from train_helpers import TINY, read_metrics, run_pretrain, train_losses


@pytest.mark.parametrize("nproc, layout", [
    (1, ["--tensorboard-dir", "TB"]),
    (2, ["--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--timing-log-level", "2"]),
    (2, ["--zero-stage", "1"]),
    (2, ["--zero-stage", "2"]),
], ids=["tp1", "tp2-domino2", "dp2-zero1", "dp2-zero2"])
def test_loss_decreases_over_30_iterations(tmp_path, corpus_prefix, nproc, layout):
    metrics = tmp_path / "metrics.jsonl"
    layout = [str(tmp_path / "tb") if arg == "TB" else arg for arg in layout]
    run_pretrain([*TINY, "--data-path", corpus_prefix, "--train-iters", "30", "--eval-interval", "15",
                  "--eval-iters", "1", "--metrics-file", str(metrics), *layout], nproc=nproc)
    losses = train_losses(metrics)
    assert sorted(losses) == list(range(1, 31))
    first, last = sum(losses[i] for i in (1, 2, 3)) / 3, sum(losses[i] for i in (28, 29, 30)) / 3
    assert last < first - 1.0, losses
    evals = [r for r in read_metrics(metrics) if "eval" in r]
    assert {r["eval"] for r in evals} == {"valid", "test"}
    record = [r for r in read_metrics(metrics) if r.get("iteration") == 30 and "eval" not in r][0]
    for key in ("lr", "grad_norm", "tokens_per_s", "tflops_per_device", "memory_gb", "consumed_samples"):
        assert record[key] is not None and record[key] > 0, key
    if "--timing-log-level" in layout:
        timers = record["timers_ms_per_iter"]
        assert {"batch-generator", "forward-backward", "optimizer", "comm-wait"} <= set(timers)
        assert 0 < timers["comm-wait"] < timers["forward-backward"]
        # Level 2: the same blocked time by call site (evaluation's left out of both), Domino's labels included.
        sites = {k: v for k, v in timers.items() if k.startswith("comm-wait: ")}
        assert sum(sites.values()) == pytest.approx(timers["comm-wait"], rel=1e-6)
        assert {"comm-wait: fwd embedding, chunk 0", "comm-wait: bwd output layer input grad",
                "comm-wait: fwd mlp, last layer, chunk 1", "comm-wait: cross-entropy"} <= set(sites), sorted(sites)
    if "--tensorboard-dir" in layout:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_tp2_with_empty_valid_and_test_splits_skips_evaluation_on_every_rank(tmp_path, corpus_prefix):
    """Only TP rank 0 reads data, but every rank must agree that there is nothing to evaluate."""
    metrics = tmp_path / "metrics.jsonl"
    run_pretrain([*TINY, "--data-path", corpus_prefix, "--split", "100,0,0", "--train-iters", "2", "--eval-interval",
                  "1", "--eval-iters", "1", "--metrics-file", str(metrics), "--tensor-model-parallel-size", "2"],
                 nproc=2, timeout=180)
    assert [r for r in read_metrics(metrics) if "eval" in r] == []
    assert sorted(train_losses(metrics)) == [1, 2]
