"""The DeepSpeed we admit is the DeepSpeed we checked: pyproject admits only the tested release line, and any
other installed release is named in one line before the run does any work."""

import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from domino.optim.deepspeed_runtime import TESTED_DEEPSPEED, untested_deepspeed
from train.train_helpers import TINY, child_env

ROOT = Path(__file__).resolve().parents[2]


def _deepspeed_requirement() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (line,) = [d for d in project["dependencies"] if Requirement(d).name == "deepspeed"]
    return Requirement(line)


def test_pyproject_admits_the_tested_release_line_and_nothing_below_it():
    spec = _deepspeed_requirement().specifier
    tested = Version(TESTED_DEEPSPEED)
    assert tested in spec
    assert Version(f"{tested.major}.{tested.minor}.{tested.micro - 1}") not in spec  # nothing older than tested
    assert Version("0.15.0") not in spec and Version("0.16.9") not in spec
    assert Version(f"{tested.major}.{tested.minor + 1}.0") not in spec  # the next minor line is unread


def test_only_the_tested_release_passes_without_a_line():
    assert untested_deepspeed(TESTED_DEEPSPEED) is None
    assert untested_deepspeed(TESTED_DEEPSPEED + "+cpu") is None  # a local build label is the same source
    line = untested_deepspeed("0.19.9")
    assert "deepspeed 0.19.9" in line and TESTED_DEEPSPEED in line and "\n" not in line


def test_a_run_with_an_untested_deepspeed_names_it_before_its_first_step(tmp_path):
    # The installed DeepSpeed reports another release; the run still trains (a warning, not a refusal).
    code = ("import sys, deepspeed; deepspeed.__version__ = '0.19.9'\n"
            "from domino.cli.main import main; main(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, "pretrain", *TINY, "--train-iters", "1", "--mock-data",
                           "--zero-stage", "1"],  # DeepSpeed's optimizer (ZeRO 0 in fp32 never imports it)
                          env=child_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    warned = [i for i, line in enumerate(lines) if "deepspeed 0.19.9 is installed" in line]
    steps = [i for i, line in enumerate(lines) if "iteration" in line and "1/" in line]
    assert len(warned) == 1 and steps and warned[0] < steps[0], "\n".join(lines[-40:])
