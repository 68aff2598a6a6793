"""A job's pretrain arguments are resolved once (``domino.launch.pretrain_args.resolve_pretrain``): the layout
searched once, the pods' argv built and parsed once on the launching machine; rendering that spec and running it
parse nothing again, and the pods receive exactly the argv that was checked (issue 38, item 4)."""

from __future__ import annotations

import pytest

from domino.launch import api, parallel_layout, pretrain_args
from domino.launch.job_api import job_api
from domino.launch.outcome import JobResult
from domino.launch.pretrain_flags import flag_value
from domino.launch.spec import JobSpec

# Four processes in one pod; a global batch of 2 leaves TP 1 (DP 4) out, TP 2 (DP 2) is the derived layout.
ARGS = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--train-iters", "4", "--micro-batch-size", "1",
        "--global-batch-size", "2"]


def _derive() -> JobSpec:
    return JobSpec(name="gpt", image="i", nodes=1, nproc_per_node=4, pretrain_args=list(ARGS),
                   parallel_layout="derive")


@pytest.fixture
def parses(monkeypatch):
    """The pretrain configurations parsed in this process (the layout search's and the check's)."""
    seen = []
    for module in (parallel_layout, pretrain_args):
        original = module.config_from_args

        def counted(args, *rest, _original=original, **kwargs):
            seen.append(args.tensor_model_parallel_size)
            return _original(args, *rest, **kwargs)
        monkeypatch.setattr(module, "config_from_args", counted)
    return seen


def _command(manifest) -> list:
    container = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    return container["command"] + container.get("args", [])


def test_the_layout_is_derived_and_the_argv_checked_once_then_rendered_as_checked(parses):
    resolved = pretrain_args.resolve_pretrain(_derive())
    assert parses == [1, 2, 2]  # the search (TP 1 refused, TP 2 taken), then the pods' argv, once
    assert resolved.derived.tensor_model_parallel_size == 2 and "TP 1:" in resolved.derived.why
    assert resolved.spec.parallel_layout == "given" and resolved.config.parallel.tensor_model_parallel_size == 2
    command = _command(job_api("pytorchjob").render(resolved.spec, "r1", None))
    assert parses == [1, 2, 2]  # rendering the resolved spec derives and parses nothing
    assert flag_value(command, "--tensor-model-parallel-size") == "2"
    pretrain = command[command.index("pretrain") + 1:]
    assert pretrain[:len(ARGS)] == ARGS and flag_value(pretrain, "--save") == flag_value(pretrain, "--load")


def test_run_job_hands_the_backend_the_resolved_spec_without_parsing_again(parses, monkeypatch):
    ran, lines = [], []

    class RecordingLauncher:  # stands in for the local backend: what reaches it is what this test checks
        def __init__(self, job_kind, log):
            pass

        def run(self, spec, run_id=None, timeout_s=None, workdir=None):
            ran.append(spec)
            return JobResult(name="gpt-r1", succeeded=True, phase="Succeeded", reason="")

    monkeypatch.setattr(api, "LocalLauncher", RecordingLauncher)
    resolved = pretrain_args.resolve_pretrain(_derive())
    before = len(parses)
    api.run_job(resolved, "local", run_id="r1", log=lines.append)
    assert len(parses) == before and ran == [resolved.spec]
    api.run_job(_derive(), "local", run_id="r1", log=lines.append)  # a spec not yet resolved: resolved once here
    assert len(parses) == 2 * before and ran[-1] == resolved.spec
    assert lines == [f"parallel layout derived for {resolved.derived.why}"] * 2
