"""What the GPU check needs on an offline device: prepared here, installed there, its result recorded here.

The device machine reaches no registry and has a CUDA build of torch of its own; everything else the check
imports (``yaml``, ``numpy``, ``deepspeed`` and DeepSpeed's own requirements) must travel with the working tree
as wheels for the device's Python, within the device tool's 64 MiB carry limit.

``prepare`` (here, with a registry):
    downloads binary wheels for manylinux x86_64 and each ``--python-versions`` entry (``pip download
    --only-binary=:all: --platform ... --python-version ...``), pinned to the versions installed here (the ones
    the tests run against), builds the DeepSpeed wheel from its sdist (PyPI has no DeepSpeed wheel; with
    ``DS_BUILD_OPS`` unset it is pure Python and JIT-builds ops only when one is used, and domino uses none),
    writes ``manifest.json`` and refuses a bundle over the limit. ``--dry-run`` prints the plan (packages,
    versions, commands) and downloads nothing.
``install`` (there, offline, standard library only):
    refuses a torch outside ``TORCH_RANGE`` or a Python the bundle has no wheels for, with one line saying
    what to do; then unpacks every wheel of this Python's tags whose package the machine lacks (or has below
    DeepSpeed's minimum) into ``--target``, which the check puts first on ``PYTHONPATH``. DeepSpeed is always
    ours (the tested version).
``record RESULT.json`` (here, by whoever ran the check):
    appends the result as a dated section to ``benchmarks/RESULTS.md`` (atomically).

    python benchmarks/gpu_check_bundle.py prepare [--dry-run] [--python-versions 3.11,3.12]
    bash benchmarks/gpu_check.sh             # on the device: install from .gpu-bundle, then run the check
    python benchmarks/gpu_check_bundle.py record gpu_check.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".gpu-bundle"  # ignored by git; the device tool's `carry` takes it along
#: The device tool's limit on carried paths (its README), less what the working tree itself takes.
CARRY_LIMIT_BYTES = 64 * 2**20
TREE_ALLOWANCE_BYTES = 4 * 2**20
#: torch versions the check runs on: ``enable_gqa=`` of ``scaled_dot_product_attention`` from 2.5,
#: ``torch.nn.RMSNorm`` from 2.4; 2.13 is the version CI tests (pyproject.toml's range).
TORCH_RANGE = ((2, 5), (2, 14))
#: Distributions the check imports besides torch: name -> (import name, minimum version the code needs).
REQUIREMENTS: Dict[str, Tuple[str, str]] = {
    "deepspeed": ("deepspeed", ""),  # always installed from the bundle
    "pyyaml": ("yaml", "6.0"), "numpy": ("numpy", "1.24"), "tqdm": ("tqdm", "4.66"),
    # DeepSpeed 0.19.8's Requires-Dist:
    "einops": ("einops", ""), "hjson": ("hjson", ""), "msgpack": ("msgpack", ""), "ninja": ("ninja", ""),
    "packaging": ("packaging", "20.0"), "psutil": ("psutil", ""), "py-cpuinfo": ("cpuinfo", ""),
    "pydantic": ("pydantic", "2.0"),
    # pydantic 2.14.4's Requires-Dist (its METADATA; pydantic-core pinned exactly, ==2.50.5, which
    # metadata_minima carries into the manifest), and typing-inspection 0.4.5's (typing-extensions>=4.15):
    "pydantic-core": ("pydantic_core", "2.50.5"), "annotated-types": ("annotated_types", "0.6.0"),
    "typing-extensions": ("typing_extensions", "4.16.0"), "typing-inspection": ("typing_inspection", "0.4.4"),
}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEFAULT_PYTHONS = "3.11,3.12"


def _version_tuple(text: str) -> Tuple[int, ...]:
    numbers = tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])
    return numbers + (0,) * (3 - len(numbers)) if numbers else ()  # 2.0 == 2.0.0; "" (no minimum) sorts first


def pinned() -> Dict[str, str]:
    """The version of every requirement installed here (the versions the tests ran with)."""
    import importlib.metadata as metadata

    return {name: metadata.version(name) for name in REQUIREMENTS}


def metadata_minima(requires: Sequence[str]) -> Dict[str, Tuple[str, str]]:
    """``{distribution: (operator, version)}``: the highest ``>=`` (or an ``==`` pin) each of ``requires`` (the
    ``Requires-Dist`` values of the bundle's wheels' METADATA) asks of a distribution of :data:`REQUIREMENTS`;
    requirements of extras or other platforms' markers are left out."""
    found: Dict[str, Tuple[str, str]] = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        if "extra" in marker or "Windows" in marker:
            continue
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*\(?\s*(>=|==)\s*([0-9][^,)\s]*)", requirement)
        if match is None:
            continue
        name, op, version = match.group(1).lower().replace("_", "-"), match.group(2), match.group(3)
        if name not in REQUIREMENTS:
            continue
        if op == "==" or name not in found or (found[name][0] != "==" and
                                                _version_tuple(version) > _version_tuple(found[name][1])):
            found[name] = (op, version)
    return found


def _wheel_requires(wheel_path: Path) -> List[str]:
    """The ``Requires-Dist`` values of a wheel's METADATA."""
    with zipfile.ZipFile(wheel_path) as wheel:
        name = next(n for n in wheel.namelist() if re.match(r"^[^/]+\.dist-info/METADATA$", n))
        text = wheel.read(name).decode("utf-8", "replace")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def download_commands(out: Path, pythons: Sequence[str], pins: Dict[str, str]) -> List[List[str]]:
    """The pip commands ``prepare`` runs: one download per Python version, one DeepSpeed build."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    wanted = [f"{name}=={version}" for name, version in pins.items() if name != "deepspeed"]
    commands = [[sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", *platforms,
                 "--python-version", py, "--dest", str(out / "wheels"), *wanted] for py in pythons]
    commands.append([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                     "--wheel-dir", str(out / "wheels"), f"deepspeed=={pins['deepspeed']}"])
    return commands


def prepare(out: Path, pythons: Sequence[str], dry_run: bool) -> Dict[str, object]:
    """Downloads and builds the bundle into ``out`` (or, with ``dry_run``, only describes it)."""
    pins = pinned()
    commands = download_commands(out, pythons, pins)
    plan = {"python_versions": list(pythons), "platforms": list(PLATFORMS), "requirements": pins,
            "torch_range": [".".join(map(str, v)) for v in TORCH_RANGE], "commands": commands,
            "limit_bytes": CARRY_LIMIT_BYTES - TREE_ALLOWANCE_BYTES}
    if dry_run:
        return plan
    (out / "wheels").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_BUILD_OPS="0")  # a pure-Python DeepSpeed wheel: ops are JIT-built if ever used
    for command in commands:
        subprocess.run(command, check=True, env=env)
    files = sorted((out / "wheels").glob("*.whl"))
    plan["files"] = {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                     for f in files}
    plan["total_bytes"] = sum(f["bytes"] for f in plan["files"].values())
    # What the wheels themselves require of each other (install keeps a machine's copy only above these).
    plan["minima"] = metadata_minima([r for f in files for r in _wheel_requires(f)])
    (out / "manifest.json").write_text(json.dumps(plan, indent=1))
    if plan["total_bytes"] > plan["limit_bytes"]:
        raise SystemExit(f"gpu_check_bundle: {out} holds {plan['total_bytes'] / 2**20:.1f} MiB of wheels, over the "
                         f"{plan['limit_bytes'] / 2**20:.0f} MiB the device tool can carry beside the tree: "
                         "prepare fewer --python-versions")
    return plan


# ---- device side: standard library only ------------------------------------------------------------------

def _wheel_tags(filename: str) -> Tuple[str, str, List[str], List[str]]:
    """``(distribution, version, python tags, abi tags)`` of a wheel's file name (PEP 427)."""
    parts = filename[:-4].split("-")
    name, version, python, abi = parts[0], parts[1], parts[-3], parts[-2]
    return name.lower().replace("_", "-"), version, python.split("."), abi.split(".")


def wheel_fits(filename: str, python: Tuple[int, int]) -> bool:
    """Whether a (manylinux x86_64 or pure) wheel of the bundle runs on CPython ``python``."""
    _, _, pythons, abis = _wheel_tags(filename)
    here = f"cp{python[0]}{python[1]}"
    if "abi3" in abis:  # the stable ABI: any CPython at or after the one it names
        return any(p.startswith("cp3") and int(p[3:]) <= python[1] for p in pythons)
    return here in pythons or (any(p in ("py3", "py2") for p in pythons) and "none" in abis)


def _installed_version(distribution: str) -> Optional[str]:
    import importlib.metadata as metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_torch(version: Optional[str]) -> None:
    """Raises SystemExit unless ``version`` (the device's torch) is within :data:`TORCH_RANGE`."""
    low, high = TORCH_RANGE
    if version is None:
        raise SystemExit("gpu_check: this machine has no torch; the check uses the device's own CUDA build of it")
    if not (low <= _version_tuple(version)[:2] < high):
        raise SystemExit(f"gpu_check: torch {version} is outside the tested range >={low[0]}.{low[1]},"
                         f"<{high[0]}.{high[1]} (pyproject.toml); use a machine or image with a torch in it")


def _unpack(wheel_path: Path, target: Path) -> None:
    """Unpacks a wheel's package tree into ``target``: its root and its ``*.data/purelib|platlib`` folders
    (the scripts, headers and data folders are not needed to import it)."""
    with zipfile.ZipFile(wheel_path) as wheel:
        for info in wheel.infolist():
            name = info.filename
            data = re.match(r"^[^/]+\.data/([^/]+)/(.*)$", name)
            if data is not None:
                if data.group(1) not in ("purelib", "platlib"):
                    continue
                name = data.group(2)
            if name.endswith("/") or not name or ".." in name.split("/"):
                continue
            destination = target / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(wheel.read(info))
            if (info.external_attr >> 16) & 0o111:
                destination.chmod(0o755)


def install(bundle: Path, target: Path, python: Tuple[int, int] = sys.version_info[:2],
            torch_version: Optional[str] = None) -> Dict[str, str]:
    """Unpacks the bundle's wheels this machine needs into ``target``; returns ``{distribution: what was done}``.

    A wheel is a zip of its package tree (PEP 427): for the pure-Python and manylinux wheels of the bundle,
    unpacking it into a directory on ``sys.path`` is what pip's install does, less the console scripts,
    which the check does not use. This needs neither pip nor network.
    """
    check_torch(torch_version if torch_version is not None else _installed_version("torch"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    done: Dict[str, str] = {}
    for distribution, version in manifest["requirements"].items():
        import_name, minimum = REQUIREMENTS.get(distribution, (distribution.replace("-", "_"), ""))
        op, needed = manifest.get("minima", {}).get(distribution, (">=", ""))
        if _version_tuple(needed) > _version_tuple(minimum):
            minimum = needed
        have = _installed_version(distribution)
        enough = have is not None and (_version_tuple(have) == _version_tuple(needed) if op == "==" else
                                       _version_tuple(have) >= _version_tuple(minimum))
        if distribution != "deepspeed" and enough:
            done[distribution] = f"present ({have})"
            continue
        matching = [w for w in wheels if _wheel_tags(w.name)[:2] == (distribution, version) and wheel_fits(w.name, python)]
        if not matching:
            raise SystemExit(f"gpu_check: {bundle} has no {distribution} {version} wheel for Python "
                             f"{python[0]}.{python[1]} (it holds {', '.join(manifest['python_versions'])}): run "
                             f"`python benchmarks/gpu_check_bundle.py prepare --python-versions "
                             f"{python[0]}.{python[1]}` here first")
        _unpack(matching[0], target)
        done[distribution] = f"installed {matching[0].name}"
    return done


# ---- record ----------------------------------------------------------------------------------------------

def record(result_file: Path, results_md: Path) -> None:
    """Appends the check's JSON as a dated section of ``results_md`` (written atomically)."""
    sys.path.insert(0, str(REPO))
    from domino.atomic_files import atomic_write_text

    result = json.loads(result_file.read_text())
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"\n## GPU check, {result.get('device', '?')}, {stamp} (`benchmarks/gpu_check.sh`)\n\n"
               f"torch {result.get('torch')}, preset {result.get('preset')}, {result.get('seconds', 0):.0f} s; "
               f"the JSON as printed:\n\n```json\n{json.dumps(result, indent=1)}\n```\n")
    atomic_write_text(str(results_md), results_md.read_text() + section)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="download and build the wheels (here)")
    p.add_argument("--out", type=Path, default=BUNDLE)
    p.add_argument("--python-versions", default=DEFAULT_PYTHONS, help=f"comma-separated (default {DEFAULT_PYTHONS})")
    p.add_argument("--dry-run", action="store_true", help="print the plan, download nothing")
    i = sub.add_parser("install", help="unpack what this machine lacks (on the device, offline)")
    i.add_argument("--bundle", type=Path, default=BUNDLE)
    i.add_argument("--target", type=Path, default=BUNDLE / "site")
    r = sub.add_parser("record", help="append a result to benchmarks/RESULTS.md")
    r.add_argument("result", type=Path)
    r.add_argument("--results", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        plan = prepare(args.out, [v.strip() for v in args.python_versions.split(",") if v.strip()], args.dry_run)
        print(json.dumps({k: v for k, v in plan.items() if k != "commands"}, indent=1))
        if args.dry_run:
            print("would run:\n" + "\n".join(" ".join(c) for c in plan["commands"]), file=sys.stderr)
        else:
            print(f"gpu_check_bundle: {len(plan['files'])} wheels, {plan['total_bytes'] / 2**20:.1f} MiB in "
                  f"{args.out} (limit {plan['limit_bytes'] / 2**20:.0f} MiB); carry it: run(carry=['.gpu-bundle'])",
                  file=sys.stderr)
    elif args.command == "install":
        for distribution, what in install(args.bundle, args.target).items():
            print(f"gpu_check_bundle: {distribution}: {what}", file=sys.stderr)
    else:
        record(args.result, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
