"""Rank-aware logging: every process logs, but only rank 0 at INFO unless asked otherwise."""

from __future__ import annotations

import logging
import os
import sys


class _RankFilter(logging.Filter):
    """Drops records below WARNING on ranks other than 0 and tags every record with its rank."""

    def __init__(self, rank: int, all_ranks: bool) -> None:
        super().__init__()
        self.rank = rank
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record, not the stream it was made with.

    A caller that swaps ``sys.stderr`` (pytest's capture, a notebook) and closes the old one would otherwise
    leave the handler writing to a closed file; ``logging.lastResort`` is built the same way for this reason.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property above wins
        pass


def setup_logging(level: str = "INFO") -> None:
    """Configures the ``domino`` logger once per process.

    The rank comes from ``RANK`` (set by torchrun and the training operator). Set
    ``DOMINO_LOG_ALL_RANKS=1`` to see INFO lines from every rank.
    """
    rank = int(os.environ.get("RANK", "0"))
    logger = logging.getLogger("domino")
    if getattr(logger, "_domino_configured", False):
        logger.setLevel(level.upper())
        return
    handler = _CurrentStderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s",
                                           "%H:%M:%S"))
    handler.addFilter(_RankFilter(rank, os.environ.get("DOMINO_LOG_ALL_RANKS") == "1"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    logger._domino_configured = True
