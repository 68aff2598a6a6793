"""Goodput: where a run's wall time went, over every attempt.

* :mod:`~domino.goodput.ledger`: rank 0's append-only, fsynced record of each attempt in ``<save>/goodput.jsonl``;
* :mod:`~domino.goodput.accounting`: the record summed into parts that add up to the wall time
  (``domino goodput --load ROOT``).

Imports neither torch nor anything else heavy: the report is read on any machine.
"""
