"""Tensor-parallel maths: collectives as autograd functions, TP layers, vocab-parallel CE, RNG, kernel choices."""
