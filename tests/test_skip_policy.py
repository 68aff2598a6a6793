"""The repository's conftest turns any skip or xfail not on its allow-list into a failed run."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SKIPPING = '''
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("no kubectl here")

@pytest.mark.xfail(reason="known broken")
def test_xfails():
    assert False
'''


#: The Makefile's `make test` options: two xdist workers, each file on one worker. The workers' reports reach
#: the controller's hooks (pytest-xdist 3.8 ``dsession.py``: ``worker_runtest_logreport``, and
#: ``worker_collectreport`` for failed or skipped collections), so the policy holds there too.
XDIST = ["-n", "2", "--dist", "loadfile"]


def _pytest(tmp_path, body: str, allowed: str = "{}", options=()):
    conftest = (REPO / "conftest.py").read_text().replace("ALLOWED_SKIPS: Dict[str, str] = {}",
                                                           f"ALLOWED_SKIPS: Dict[str, str] = {allowed}")
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_sample.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("options", [(), XDIST], ids=["serial", "xdist"])
def test_a_skip_or_xfail_fails_the_run_and_is_named(tmp_path, options):
    proc = _pytest(tmp_path, SKIPPING, options=options)
    assert proc.returncode == 1, proc.stdout
    assert "1 passed, 1 skipped, 1 xfailed" in proc.stdout
    assert "test_sample.py::test_skips (skipped: Skipped: no kubectl here)" in proc.stdout
    assert "test_sample.py::test_xfails (xfail: known broken)" in proc.stdout


@pytest.mark.parametrize("options", [(), XDIST], ids=["serial", "xdist"])
def test_a_module_skipped_at_collection_fails_the_run(tmp_path, options):
    proc = _pytest(tmp_path, 'import pytest\npytest.importorskip("no_such_module_here")\n\ndef test_x():\n    pass\n',
                   options=options)
    assert proc.returncode == 1, proc.stdout
    assert "no_such_module_here" in proc.stdout.split("did not run")[1]


def test_allow_listed_skips_pass(tmp_path):
    allowed = '{"test_sample.py::test_skips": "needs a GPU", "test_sample.py::test_xfails": "upstream bug"}'
    proc = _pytest(tmp_path, SKIPPING, allowed)
    assert proc.returncode == 0, proc.stdout
    assert "did not run" not in proc.stdout

