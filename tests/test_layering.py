"""The import layering of ``domino/``: every import of every module (function-local ones and constant
``importlib.import_module`` names included), read with ``ast``, goes down the floors of :data:`FLOORS`, so no
package imports one above it or beside it and no circle between packages exists; and ``launch/``'s modules
import each other without a circle."""

import ast
import os
from collections import defaultdict
from typing import Dict, List, Set, Tuple

import domino

ROOT = os.path.dirname(os.path.abspath(domino.__file__))

#: The floors, lowest first: a package may import packages of lower floors only (not its neighbours on the
#: same floor). ``domino`` is the package root (its ``__version__``).
FLOORS: List[Tuple[str, ...]] = [
    ("domino", "file_lock", "logging_utils", "child_signals", "redact"),
    ("atomic_files", "images", "goodput"),  # safe files; image names; the goodput ledger
    ("config",),                      # typed configs, flags, presets, validation
    ("runtime", "launch", "tracking"),  # process groups; jobs on a cluster (no torch model); MLflow
    ("parallel",),                    # tensor-parallel maths
    ("model", "data"),                # the model takes tensors: it never imports data, nor data the model
    ("overlap", "pipeline"),          # the Domino schedule, pipeline stages: applied to a model from outside
    ("optim",),                       # the optimizer behind one interface; DeepSpeed lives here alone
    ("checkpoint",),                  # the format, and building a model from it
    ("train", "eval"),
    ("cli",),
    ("__main__",),
]
FLOOR = {package: level for level, packages in enumerate(FLOORS) for package in packages}
#: Imports that go against the floors on purpose, each with its reason.
ALLOWED = {
    # `domino pipeline ...` is the kfp layer's own command line; only this verb module reaches it, when the
    # verb runs, so the core installs and runs without kfp (tests/pipelines/test_pipeline_params.py checks).
    ("domino/cli/pipeline.py", "pipelines"),
}


def _modules() -> Dict[str, str]:
    """``{dotted module name: file path}`` of every module under domino/."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = "domino." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imported(tree: ast.AST, module: str) -> List[Tuple[str, int]]:
    """Every module ``module``'s source imports, with its line: ``import``, ``from`` (a name that is a
    submodule counts as that submodule), relative imports, and constant ``importlib.import_module`` names."""
    package = module if MODULES.get(module, "").endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in MODULES else base, node.lineno))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.args[0].value, node.lineno))
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "domino"


def _graph() -> Dict[str, List[Tuple[str, int]]]:
    graph = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as handle:
            graph[module] = _imported(ast.parse(handle.read(), path), module)
    return graph


GRAPH = _graph()


def _where(module: str, line: int) -> str:
    return f"{os.path.relpath(MODULES[module], os.path.dirname(ROOT))}:{line}"


def test_every_package_has_a_floor():
    packages = {_package(m) for m in MODULES}
    assert packages <= set(FLOOR), f"add {sorted(packages - set(FLOOR))} to FLOORS"


def test_no_package_imports_one_above_or_beside_it():
    wrong = []
    for module, imports in GRAPH.items():
        source = _package(module)
        for target, line in imports:
            top = target.split(".")[0]
            if top in ("components", "pipelines"):
                if (os.path.relpath(MODULES[module], os.path.dirname(ROOT)), top) not in ALLOWED:
                    wrong.append(f"{_where(module, line)}: {module} imports {target} (the core never imports the "
                                 "kfp layer)")
                continue
            if top != "domino":
                continue
            package = _package(target)
            if package != source and FLOOR[package] >= FLOOR[source]:
                wrong.append(f"{_where(module, line)}: {source} (floor {FLOOR[source]}) imports {target} "
                             f"(floor {FLOOR[package]})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_no_import_circle_between_packages():
    edges: Dict[str, Set[str]] = defaultdict(set)
    for module, imports in GRAPH.items():
        for target, _ in imports:
            if target.split(".")[0] == "domino" and _package(target) != _package(module):
                edges[_package(module)].add(_package(target))
    assert _cycles(edges) == []


def test_deepspeed_is_imported_inside_domino_optim_only():
    """DeepSpeed is one adapter's business (issue #55): the loop, the pipeline step and the checkpoint manager see
    :class:`domino.optim.interface.TrainingOptimizer` only, so an upgrade of DeepSpeed touches one package."""
    outside = [f"{_where(module, line)}: {module} imports {target}" for module, imports in GRAPH.items()
               for target, line in imports if target.split(".")[0] == "deepspeed"
               and _package(module) != "optim"]
    assert outside == []


def _class_assignments(tree: ast.AST) -> List[int]:
    """Lines assigning ``__class__`` on an object (``x.__class__ = ...``, ``setattr(x, "__class__", ...)``)."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        lines += [node.lineno for t in targets if isinstance(t, ast.Attribute) and t.attr == "__class__"]
        if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__class__"):
            lines.append(node.lineno)
    return lines


def test_no_live_object_has_its_class_swapped():
    """Issue #55 item 1: DeepSpeed's optimizers and loss scaler are domino's subclasses made at construction
    (``domino.optim.deepspeed_engine``), never a live object's ``__class__`` reassigned."""
    swapped = []
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as handle:
            swapped += [_where(module, line) for line in _class_assignments(ast.parse(handle.read(), path))]
    assert swapped == []


def test_the_class_swap_finder_sees_both_forms():
    tree = ast.parse("a.__class__ = B\nsetattr(a, '__class__', B)\nb.cls = C\n")
    assert _class_assignments(tree) == [1, 2]


def test_no_import_circle_within_launch():
    edges: Dict[str, Set[str]] = defaultdict(set)
    for module, imports in GRAPH.items():
        if module.startswith("domino.launch."):
            edges[module] |= {t for t, _ in imports if t.startswith("domino.launch.") and t != module}
    assert _cycles(edges) == []


def test_the_reader_sees_what_a_circle_looks_like():
    """The cycle finder itself: a two-module circle and a self-contained chain."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}}) == []


def test_no_production_module_is_over_400_lines():
    """The house rule (modules of 150-400 lines): a file past it holds more than one concept and is split."""
    repo = os.path.dirname(ROOT)
    long = []
    for top in ("domino", "components", "pipelines"):
        for folder, _, files in os.walk(os.path.join(repo, top)):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".py"):
                    with open(path) as handle:
                        count = sum(1 for _ in handle)
                    if count > 400:
                        long.append(f"{os.path.relpath(path, repo)}: {count} lines")
    assert long == []


def _kfp_layer_graph() -> Dict[str, Set[str]]:
    """``{module: kfp-layer modules it imports}`` over components/ and pipelines/ (every import, function-local
    ones included, read with ``ast`` as :func:`_imported` reads domino/'s)."""
    repo = os.path.dirname(ROOT)
    files = {}
    for top in ("components", "pipelines"):
        for folder, _, names in os.walk(os.path.join(repo, top)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    files[os.path.relpath(path, repo)[:-3].replace(os.sep, ".").removesuffix(".__init__")] = path
    edges: Dict[str, Set[str]] = {}
    for module, path in files.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        edges[module] = {t for t in targets if t in files and t != module}
    return edges


def test_the_kfp_layer_imports_in_one_direction():
    """pipelines/ -> the generated components/kfp_functions.py -> components/*/component.py -> step.py: no
    module of components/ or pipelines/ reaches back up that chain, and components/ never imports pipelines/."""
    edges = _kfp_layer_graph()
    assert _cycles(edges) == []
    back = sorted(f"{m} imports {t}" for m, ts in edges.items() if m.startswith("components") for t in ts
                  if t.startswith("pipelines"))
    assert back == []
    assert "components.kfp_functions" in edges["pipelines.gpt_pretrain"] | edges["pipelines.preprocess_stage"]
