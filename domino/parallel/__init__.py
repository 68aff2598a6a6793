"""Tensor parallelism: process groups, collectives as autograd functions, TP layers, vocab-parallel CE, RNG."""
