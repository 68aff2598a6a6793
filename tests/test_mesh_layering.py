"""Issue 38's first measure, enforced: below the entry points the parallel layout is a value passed down (a
``ParallelMesh`` or one of its ``MeshGroup`` s), not read from ``domino.runtime.state``'s process-wide mesh.

The model, its layers, their collectives, the overlapped stacks, the losses and the evaluation metrics take their
group as an argument; no module of those packages imports the shim. The modules that still read it are listed
here, each one a place the mesh has yet to be passed to (the list only shrinks)."""

from test_layering import GRAPH, _where

SHIM = "domino.runtime.state"
#: Packages whose modules never read the global mesh.
MESH_PASSED = ("domino.parallel", "domino.model", "domino.overlap", "domino.pipeline", "domino.eval.metrics",
               "domino.eval.generate", "domino.eval.evaluate", "domino.data", "domino.train.gpt_recipe",
               "domino.checkpoint")
#: The entry points, which start the run and pass its mesh down (``state.start`` returns it; training's start,
#: ``domino.train.runtime_start.initialize_runtime``, returns it too); ``domino.runtime.restart`` tears the
#: process-wide state down for an in-process restart, before the entry point starts it again.
ENTRY_POINTS = {"domino.train.pretrain", "domino.train.runtime_start", "domino.eval.runtime", "domino.runtime",
                "domino.runtime.restart"}
#: Modules below the entry points that still read the shim (the list only shrinks; empty now: DeepSpeed's engine is
#: built over the mesh too, ``domino.optim.deepspeed_mpu``).
STILL_READING: set = set()


def _readers():
    return {module: line for module, imports in GRAPH.items() for target, line in imports
            if target == SHIM and module != SHIM}


def test_the_model_layers_collectives_and_metrics_never_read_the_global_mesh():
    wrong = [f"{_where(module, line)}: {module} imports {SHIM}" for module, line in _readers().items()
             if module.startswith(MESH_PASSED)]
    assert not wrong, "pass the mesh (or its group) down instead:\n" + "\n".join(wrong)


def test_only_the_entry_points_and_the_listed_modules_read_the_global_mesh():
    readers = set(_readers())
    new = sorted(readers - ENTRY_POINTS - STILL_READING)
    assert not new, f"new readers of {SHIM} (pass the mesh down instead): {new}"
    gone = sorted(STILL_READING - readers)
    assert not gone, f"these no longer read {SHIM}: take them off STILL_READING: {gone}"


#: The run's environment settings, each read by the entry points only and passed down as a value (issue 55,
#: item 5): the emulated TP link and the kernel choice.
ENVIRONMENT_READERS = {"link_from_environment": {"domino/train/runtime_start.py"},
                       "from_environment": {"domino/cli/pretrain.py"}}  # domino.parallel.kernels


def test_the_environment_settings_are_read_at_the_entry_points_only():
    import os
    import re

    from test_layering import ROOT

    found = {call: set() for call in ENVIRONMENT_READERS}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                for call in ENVIRONMENT_READERS:
                    # A call, not the definition (``def link_from_environment(``).
                    if re.search(r"(?<!def )\b" + call + r"\(", text):
                        found[call].add(os.path.relpath(path, os.path.dirname(ROOT)))
    assert found == ENVIRONMENT_READERS, "read the environment at the entry point and pass the value down"
