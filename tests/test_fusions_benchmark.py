"""``benchmarks/fusions.py`` compares like with like: its four losses (the plain path, the one-buffer loss, the
chunked loss as committed before the one-pass change, read from git, and the one-pass chunked loss) compute the
same losses and gradients on its inputs, and its norm and GeLU pairs the same outputs. No timing is asserted."""

import argparse

import torch

from benchmark_helpers import load_benchmark


def test_the_ways_it_times_compute_the_same_things():
    fusions = load_benchmark("fusions")
    args = argparse.Namespace(tokens=24, hidden=16, vocab=64, chunk_mib=1, before=fusions.BEFORE)
    ways, rows = fusions._loss_ways(args)
    assert rows == 2**20 // (4 * 64) and list(ways) == list(fusions.LOSSES)
    args.chunk_mib = 0  # one row per chunk: several chunks on these few tokens
    ways, rows = fusions._loss_ways(args)
    results = []
    for fn in ways.values():
        hidden, weight, target = fusions._loss_inputs(args)
        loss = fn(hidden, weight, target)
        loss.sum().backward()
        results.append((loss.detach(), hidden.grad, weight.grad))
    for other in results[1:]:
        for a, e in zip(other, results[0]):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    for pair, x in fusions._norm_ways(argparse.Namespace(tokens=6, hidden=8)).values():
        torch.testing.assert_close(pair["torch"](x), pair["textbook"](x), rtol=1e-5, atol=1e-6)
