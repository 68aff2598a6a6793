"""Overlapped layer stacks applied to a built ``GPTModel`` from outside: the Domino schedule and sequence parallelism.

* :mod:`~domino.overlap.schedule` - :func:`~domino.overlap.schedule.apply_domino`: N batch chunks as a wavefront,
  every tensor-parallel collective of one chunk hidden behind the other chunks' steps;
* :mod:`~domino.overlap.sequence_parallel` - :func:`~domino.overlap.sequence_parallel.apply_sequence_parallel`:
  the residual stream split along the sequence (Megatron's sequence parallelism), with or without Domino;
* :mod:`~domino.overlap.steps` - one chunk's way through the layers' own steps
  (:meth:`~domino.model.transformer.TransformerLayer.steps`), and the asynchronous reducer they hand over to;
* :mod:`~domino.overlap.slots` - the gradient slots the column-parallel linears launch their input gradient's
  reduction into (they implement :class:`domino.parallel.linear_ops.GradSlot`), and the nodes that wait for it;
* :mod:`~domino.overlap.sequence_collectives` - the split-phase sequence regions (launch now, wait later).

The model files import nothing from here: a model with one chunk and no sequence parallelism runs (and loads)
none of it. This package imports nothing at import time, so loading one of its modules loads no other.
"""
