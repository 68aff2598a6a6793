"""The launcher's flags (``domino launch render|submit|check|smoke``) are derived from :class:`JobSpec`'s fields:
the same spellings, types, defaults and choices as the flags once written by hand (pinned below), help from
the field docstrings, and a full command line builds the spec it says."""

import argparse

import pytest

from domino.launch.flags import add_spec_flags, spec_from_args
from domino.launch.spec import JobSpec, LaunchSpecError, Toleration

#: (spellings, action, type, default, choices, nargs, required) of every flag, as hand-written in 2026-11.
SURFACE = [
    (("--name",), "store", "str", None, None, None, True),
    (("--image",), "store", "str", None, None, None, False),
    (("--namespace",), "store", "str", None, None, None, False),
    (("--run-id",), "store", "str", None, None, None, False),
    (("--owner",), "store", "str", None, None, None, False),
    (("--command",), "store", "str", None, None, None, False),
    (("--nodes",), "store", "int", 1, None, None, False),
    (("--nproc-per-node",), "store", "nproc", 1, None, None, False),
    (("--gpus-per-node",), "store", "int", 0, None, None, False),
    (("--cpu-request",), "store", "str", None, None, None, False),
    (("--cpu-limit",), "store", "str", None, None, None, False),
    (("--memory-request",), "store", "str", None, None, None, False),
    (("--memory-limit",), "store", "str", None, None, None, False),
    (("--gpu-memory-gb",), "store", "float", None, None, None, False),
    (("--parallel-layout",), "store", "str", "given", ("given", "derive"), None, False),
    (("--shm-size",), "store", "str", "16Gi", None, None, False),
    (("--pvc",), "store", "str", "domino-data", None, None, False),
    (("--mount-path",), "store", "str", "/mnt/domino", None, None, False),
    (("--checkpoint-dir",), "store", "str", None, None, None, False),
    (("--node-selector",), "append", "str", [], None, None, False),
    (("--toleration",), "append", "str", [], None, None, False),
    (("--rdma-resource",), "append", "str", [], None, None, False),
    (("--no-gpu-toleration",), "store_false", None, True, None, 0, False),
    (("--priority-class",), "store", "str", None, None, None, False),
    (("--image-pull-secret",), "append", "str", [], None, None, False),
    (("--image-pull-policy",), "store", "str", "IfNotPresent", ("Always", "IfNotPresent", "Never"), None, False),
    (("--service-account",), "store", "str", None, None, None, False),
    (("--queue",), "store", "str", None, None, None, False),
    (("--scheduling-policy",), "store_true", None, False, None, 0, False),
    (("--env",), "append", "str", [], None, None, False),
    (("--env-secret",), "append", "str", [], None, None, False),
    (("--env-from-secret",), "append", "str", [], None, None, False),
    (("--label",), "append", "str", [], None, None, False),
    (("--annotation",), "append", "str", [], None, None, False),
    (("--restart-policy",), "store", "str", "OnFailure", ("OnFailure", "ExitCode"), None, False),
    (("--backoff-limit",), "store", "int", None, None, None, False),
    (("--termination-grace-period",), "store", "int", 180, None, None, False),
    (("--start-timeout",), "store", "int", 1200, None, None, False),
    (("--active-deadline-seconds",), "store", "int", None, None, None, False),
    (("--ttl-seconds-after-finished",), "store", "int", 86400, None, None, False),
    (("--clean-pod-policy",), "store", "str", "Running", ("All", "Running", "None"), None, False),
    ((), "store", "str", None, None, "...", True),
]
_ACTIONS = {argparse._StoreAction: "store", argparse._AppendAction: "append", argparse._StoreTrueAction: "store_true",
            argparse._StoreFalseAction: "store_false"}


def _parser():
    parser = argparse.ArgumentParser()
    add_spec_flags(parser)
    return parser


def _kind(function):
    if function is None or function is str:
        return "str"
    name = getattr(function, "__name__", "")
    return "nproc" if "nproc" in name else name


def test_the_flags_keep_their_spellings_types_defaults_and_choices():
    actions = [a for a in _parser()._actions if not isinstance(a, argparse._HelpAction)]
    got = [(tuple(a.option_strings), _ACTIONS[type(a)], None if a.nargs == 0 else _kind(a.type),
            list(a.default) if isinstance(a.default, list) else a.default,
            tuple(a.choices) if a.choices else None, a.nargs, a.required) for a in actions]
    assert sorted(got, key=repr) == sorted(SURFACE, key=repr)
    nproc = next(a for a in actions if a.option_strings == ["--nproc-per-node"]).type
    assert (nproc("4"), nproc("auto")) == (4, "auto")


FULL = ["--name", "gpt", "--image", "img:1", "--namespace", "ns", "--run-id", "r1", "--owner", "me",
        "--command", "python -m x 'a b'", "--nodes", "2", "--nproc-per-node", "gpu", "--gpus-per-node", "8",
        "--cpu-request", "8", "--cpu-limit", "16", "--memory-request", "64Gi", "--memory-limit", "128Gi",
        "--gpu-memory-gb", "80", "--parallel-layout", "derive", "--shm-size", "", "--pvc", "claim",
        "--mount-path", "/mnt/d", "--checkpoint-dir", "/mnt/d/ck", "--node-selector", "pool=a",
        "--node-selector", "zone=b", "--toleration", "gpu=yes:NoSchedule", "--toleration", "spot",
        "--rdma-resource", "rdma/x=1", "--no-gpu-toleration", "--priority-class", "high",
        "--image-pull-secret", "regcred", "--image-pull-policy", "Always", "--service-account", "trainer",
        "--queue", "q", "--scheduling-policy", "--env", "A=1", "--env-secret", "HF_TOKEN=hf:token",
        "--env-from-secret", "bundle", "--label", "team=ml", "--annotation", "note=x",
        "--restart-policy", "ExitCode", "--backoff-limit", "5", "--termination-grace-period", "60",
        "--start-timeout", "300", "--active-deadline-seconds", "3600", "--ttl-seconds-after-finished", "60",
        "--clean-pod-policy", "All", "--", "--preset", "tiny"]


def test_every_flag_lands_in_its_field():
    spec = spec_from_args(_parser().parse_args(FULL))
    assert spec == JobSpec(
        name="gpt", image="img:1", pretrain_args=["--preset", "tiny"], command=["python", "-m", "x", "a b"],
        namespace="ns", nodes=2, nproc_per_node="gpu", gpus_per_node=8, cpu_request="8", cpu_limit="16",
        memory_request="64Gi", memory_limit="128Gi", shm_size=None, pvc="claim", mount_path="/mnt/d",
        checkpoint_dir="/mnt/d/ck", node_selector={"pool": "a", "zone": "b"},
        tolerations=[Toleration("gpu", "yes", "NoSchedule", "Equal"), Toleration("spot", "", "", "Exists")],
        gpu_toleration=False, rdma_resources={"rdma/x": "1"}, priority_class="high", image_pull_secrets=["regcred"],
        image_pull_policy="Always", service_account="trainer", env={"A": "1"}, secret_env={"HF_TOKEN": "hf:token"},
        env_from_secrets=["bundle"], labels={"team": "ml"}, annotations={"note": "x"}, owner="me",
        restart_policy="ExitCode", backoff_limit=5, active_deadline_seconds=3600, ttl_seconds_after_finished=60,
        clean_pod_policy="All", termination_grace_period_s=60, start_timeout_s=300, queue="q",
        scheduling_policy=True, gpu_memory_gb=80.0, parallel_layout="derive")


def test_the_defaults_are_the_specs(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "from-env")
    spec = spec_from_args(_parser().parse_args(["--name", "gpt", "--image", "img:1"]))
    assert spec == JobSpec(name="gpt", image="img:1")
    assert spec.namespace == "from-env"


def test_a_bad_key_value_names_its_flag():
    with pytest.raises(LaunchSpecError, match="--rdma-resource: expected KEY=VALUE"):
        spec_from_args(_parser().parse_args(["--name", "gpt", "--image", "i", "--rdma-resource", "x"]))


def test_each_field_is_one_flag_helped_by_its_docstring():
    import ast
    import dataclasses

    from domino.config.field_docs import field_docs
    from domino.launch import flags

    docs = field_docs(JobSpec)
    by_dest = {a.dest: a for a in _parser()._actions}
    for f in dataclasses.fields(JobSpec):
        if f.name in flags.NO_FLAG:
            assert f.name not in by_dest or f.name == "pretrain_args"
            continue
        assert by_dest[f.name].help.replace("%%", "%").startswith(" ".join(docs[f.name].split())), f.name
    # No flag of a field is written by hand: flags.py adds only --run-id (not a field) and the pretrain args.
    with open(flags.__file__, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    written = [node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", "") == "add_argument" and isinstance(node.args[0], ast.Constant)]
    assert written == ["--run-id", "pretrain_args"]
