"""The one error type of the data pipeline: bad input data, named by file, line or field."""

from __future__ import annotations

from domino.config import ConfigError


class DataError(ConfigError):
    """Input data (a text file, an ``.idx``/``.bin`` pair, a tokenizer file, a cache) that cannot be used.

    Subclasses :class:`domino.config.ConfigError`, so the ``domino`` command reports it as a one-line
    error with exit status 2 instead of a traceback. The message always names the file and, where it
    applies, the line or the field that is wrong.
    """
