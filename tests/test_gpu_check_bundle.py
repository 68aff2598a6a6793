"""benchmarks/gpu_check_bundle.py: the plan of what travels to the offline device (no download here), the
offline install there (real wheel files, unpacked and imported in a fresh interpreter), the refusals, and the
recording of a result into RESULTS.md."""

import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmark_helpers import load_benchmark

REPO = Path(__file__).resolve().parents[1]


def _bundle_module():
    return load_benchmark("gpu_check_bundle")


def test_prepare_dry_run_plans_pinned_binary_wheels_for_each_python_and_downloads_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check_bundle.py"), "prepare", "--dry-run",
                           "--out", str(tmp_path / "bundle"), "--python-versions", "3.11,3.12"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert not (tmp_path / "bundle").exists()
    module = _bundle_module()
    assert set(plan["requirements"]) == set(module.REQUIREMENTS)
    assert plan["requirements"]["deepspeed"] == importlib.metadata.version("deepspeed")  # the tested version
    assert plan["limit_bytes"] <= 64 * 2**20 and plan["torch_range"] == ["2.5", "2.14"]
    lines = proc.stderr.split("would run:\n", 1)[1].splitlines()
    downloads = [line for line in lines if " download " in line]
    assert [line.split("--python-version ")[1].split()[0] for line in downloads] == ["3.11", "3.12"]
    assert all("--only-binary=:all:" in line and "--platform manylinux_2_17_x86_64" in line for line in downloads)
    assert any(" wheel " in line and "--no-build-isolation" in line and "deepspeed==" in line for line in lines)


def _wheel(directory: Path, filename: str, files: dict) -> None:
    with zipfile.ZipFile(directory / filename, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


@pytest.fixture
def bundle(tmp_path):
    """A bundle of real wheel files for a made-up distribution, one build per CPython, plus a pure one."""
    wheels = tmp_path / "bundle" / "wheels"
    wheels.mkdir(parents=True)
    for tag in ("cp311", "cp312"):
        _wheel(wheels, f"h30_fake-1.0-{tag}-{tag}-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", {
            "h30_fake/__init__.py": f"BUILD = '{tag}'\n",
            "h30_fake-1.0.data/purelib/h30_fake_extra.py": "EXTRA = True\n",
            "h30_fake-1.0.data/scripts/h30-fake": "#!/bin/sh\n",
            "h30_fake-1.0.dist-info/METADATA": "Name: h30-fake\nVersion: 1.0\n"})
    _wheel(wheels, "h30_pure-2.0-py3-none-any.whl", {"h30_pure.py": "PURE = 2\n",
                                                      "h30_pure-2.0.dist-info/METADATA": "Name: h30-pure\n"})
    (tmp_path / "bundle" / "manifest.json").write_text(json.dumps({
        "requirements": {"h30-fake": "1.0", "h30-pure": "2.0"}, "python_versions": ["3.11", "3.12"]}))
    return tmp_path / "bundle"


def test_install_unpacks_this_pythons_wheels_offline_and_they_import(bundle, tmp_path):
    module = _bundle_module()
    target = tmp_path / "site"
    done = module.install(bundle, target, python=(3, 12), torch_version="2.13.0+cu128")
    assert done["h30-fake"].startswith("installed h30_fake-1.0-cp312-")
    assert not (target / "h30-fake").exists() and not list(target.rglob("*scripts*"))
    code = "import h30_fake, h30_fake_extra, h30_pure; print(h30_fake.BUILD, h30_fake_extra.EXTRA, h30_pure.PURE)"
    proc = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": str(target)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.split() == ["cp312", "True", "2"], proc.stderr


def test_install_refuses_a_python_without_wheels_and_a_torch_outside_the_range(bundle, tmp_path):
    module = _bundle_module()
    with pytest.raises(SystemExit, match=r"no h30-fake 1.0 wheel for Python 3.10 .*--python-versions 3.10"):
        module.install(bundle, tmp_path / "site", python=(3, 10), torch_version="2.13.0")
    with pytest.raises(SystemExit, match=r"torch 2.4.1 is outside the tested range >=2.5,<2.14"):
        module.install(bundle, tmp_path / "site", python=(3, 12), torch_version="2.4.1")
    with pytest.raises(SystemExit, match="no torch"):
        module.check_torch(None)


@pytest.mark.parametrize("filename, python, fits", [
    ("numpy-2.4.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl", (3, 12), True),
    ("numpy-2.4.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl", (3, 11), False),
    ("psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.manylinux_2_28_x86_64.whl", (3, 11), True),
    ("ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", (3, 13), True),
    ("tqdm-4.70.1-py3-none-any.whl", (3, 10), True),
])
def test_wheel_tags_decide_which_python_a_wheel_serves(filename, python, fits):
    assert _bundle_module().wheel_fits(filename, python) is fits


def test_record_appends_the_result_as_a_dated_section(tmp_path):
    results, result = tmp_path / "RESULTS.md", tmp_path / "gpu_check.json"
    results.write_text("# Measured figures\n")
    result.write_text(json.dumps({"device": "NVIDIA H200", "torch": "2.9.0", "preset": "gpt3-1.3b", "seconds": 401.2,
                                  "mfu": 0.41}))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check_bundle.py"), "record", str(result),
                           "--results", str(results)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    text = results.read_text()
    assert text.startswith("# Measured figures\n\n## GPU check, NVIDIA H200, ")
    assert '"mfu": 0.41' in text and "torch 2.9.0, preset gpt3-1.3b, 401 s" in text


def test_the_device_checks_torch_range_is_pyprojects():
    import re
    import tomllib

    spec = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                if re.match(r"torch\b", d))
    low, high = re.fullmatch(r"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)", spec).group(1, 2), \
        re.fullmatch(r"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)", spec).group(3, 4)
    assert _bundle_module().TORCH_RANGE == (tuple(map(int, low)), tuple(map(int, high)))


def test_the_minima_are_at_least_what_the_pinned_wheels_metadata_requires():
    """The bundle's wheels are the versions installed here, so their METADATA is these dists' Requires-Dist:
    no minimum of REQUIREMENTS may be below what another wheel requires (pydantic 2.14.4 needs
    typing-extensions>=4.16.0; the table said 4.12, and a machine's 4.12 would have been kept)."""
    module = _bundle_module()
    requires = [r for name in module.REQUIREMENTS for r in (importlib.metadata.requires(name) or [])]
    needed = module.metadata_minima(requires)
    assert needed["typing-extensions"][1] == "4.16.0" and needed["pydantic-core"][0] == "=="
    for name, (op, version) in needed.items():
        table = module.REQUIREMENTS[name][1]
        assert module._version_tuple(table) >= module._version_tuple(version), (name, table, op, version)


def test_prepare_records_the_wheels_minima_and_install_replaces_a_copy_below_them(tmp_path):
    module = _bundle_module()
    wheels = tmp_path / "bundle" / "wheels"
    wheels.mkdir(parents=True)
    _wheel(wheels, "tqdm-99.0-py3-none-any.whl", {"tqdm_h40_marker.py": "OURS = True\n",
                                                   "tqdm-99.0.dist-info/METADATA": "Name: tqdm\nVersion: 99.0\n"})
    _wheel(wheels, "h30_user-1.0-py3-none-any.whl", {"h30-user-1.0.dist-info/METADATA":
                                                      "Name: h30-user\nRequires-Dist: tqdm>=99.0\n"
                                                      "Requires-Dist: numpy (>=1.0) ; extra == 'x'\n"})
    minima = module.metadata_minima([r for w in sorted(wheels.glob("*.whl")) for r in module._wheel_requires(w)])
    assert minima == {"tqdm": (">=", "99.0")}
    (tmp_path / "bundle" / "manifest.json").write_text(json.dumps({
        "requirements": {"tqdm": "99.0"}, "python_versions": ["3.11"], "minima": minima}))
    done = module.install(tmp_path / "bundle", tmp_path / "site", python=(3, 11), torch_version="2.13.0")
    assert done == {"tqdm": "installed tqdm-99.0-py3-none-any.whl"}  # this machine's tqdm is below 99.0
    assert (tmp_path / "site" / "tqdm_h40_marker.py").exists()
