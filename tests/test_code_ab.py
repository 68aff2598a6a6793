"""``benchmarks/code_ab.py``: two trees of the code in one process, the "before" one renamed."""

import os
import subprocess
import sys

from benchmark_helpers import REPO, load_benchmark


def test_the_before_tree_is_renamed_so_both_import_side_by_side(tmp_path):
    load_benchmark("code_ab")._renamed_copy(str(REPO), str(tmp_path))
    probe = ("import domino, domino_before, domino_before.model.transformer as t; "
             "assert domino_before.__file__ != domino.__file__ and 'domino_before' in t.__file__; "
             "assert t.RowParallelLinear.__module__ == 'domino_before.parallel.layers'")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, cwd=tmp_path)


def test_one_pair_of_the_tiny_shape_runs():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "code_ab.py"), "--before", str(REPO),
                           "--shape", "tiny", "--pairs", "2", "--warmup", "1"],
                          capture_output=True, text=True, check=True, cwd=REPO)
    assert "sync: before median" in done.stdout and "domino2: before median" in done.stdout
