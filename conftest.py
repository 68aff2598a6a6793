"""Repository-wide pytest policy: a test that does not run fails the run.

A skip (``pytest.skip``, ``skipif``, ``importorskip``, a skipped module at collection) or an ``xfail``
turns a green run into a run that proved less than it claims. Each one must be on ``ALLOWED_SKIPS``
below, with the reason it cannot run everywhere (today: none). Otherwise the run's exit status is 1 and
the summary names the test. docs/testing.md describes the policy.
"""

from __future__ import annotations

from typing import Dict, List

import pytest

#: node id (or node-id prefix) -> why it may skip on the CPU machines that run `make test`. Keep it short:
#: only tests that need hardware CI does not have (a GPU) belong here.
ALLOWED_SKIPS: Dict[str, str] = {}

_UNEXPECTED: List[str] = []


def _allowed(nodeid: str) -> bool:
    return any(nodeid == allowed or nodeid.startswith(allowed + "::") for allowed in ALLOWED_SKIPS)


def _record(report) -> None:
    reason = ""
    if report.skipped:
        reason = "xfail" if hasattr(report, "wasxfail") else "skipped"
    if reason and not _allowed(report.nodeid):
        _UNEXPECTED.append(f"{report.nodeid or '<collection>'} ({reason}: {_longrepr(report)})")


def _longrepr(report) -> str:
    if hasattr(report, "wasxfail"):
        return report.wasxfail or "no reason given"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr).splitlines()[-1] if longrepr else ""


def pytest_runtest_logreport(report) -> None:
    _record(report)


def pytest_collectreport(report) -> None:
    _record(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _UNEXPECTED and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _UNEXPECTED:
        terminalreporter.section("tests that did not run (not on conftest.ALLOWED_SKIPS)", red=True)
        for line in _UNEXPECTED:
            terminalreporter.line(line)
        terminalreporter.line("A skipped test proves nothing: make it run here, or add it to ALLOWED_SKIPS with "
                              "the reason (docs/testing.md). The run fails.")
