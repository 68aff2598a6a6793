"""Parallel maths: collectives as autograd functions, TP layers, vocab-parallel CE, RNG, kernel choices, and
context parallelism's ring attention and sequence split."""
