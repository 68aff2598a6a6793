"""The domino logger writes to the stderr of the moment, so a swapped and closed stderr loses nothing."""

import io
import logging
import sys

from domino.logging_utils import setup_logging


def test_records_go_to_the_current_stderr_after_the_old_one_is_closed(monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging("INFO")
    logging.getLogger("domino.test").info("to the first")
    first.close()  # what pytest's capture does to a test's stderr when the test ends
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("domino.test").info("to the second")
    assert "INFO domino.test: to the second" in second.getvalue() and "Logging error" not in second.getvalue()
