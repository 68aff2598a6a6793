"""The compiled pipeline: golden file, determinism, structure, platform (PVC, node) settings."""

import os

import pytest
import yaml

from components import DEFAULT_IMAGE
from pipelines import COMPILED_PATH, MOUNT_PATH, StepPlacement, build_pipeline, compile_pipeline

STEPS = ("exec-train-tokenizer", "exec-plan-preprocess", "exec-preprocess", "exec-merge-datasets", "exec-pretrain",
         "exec-evaluate", "exec-promote-model", "exec-cleanup-job")


def _compile(tmp_path, **kwargs):
    path = compile_pipeline(str(tmp_path / "p.yaml"), **kwargs)
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    docs = list(yaml.safe_load_all(text))
    return text, docs[0], (docs[1] if len(docs) > 1 else {})


def test_committed_yaml_matches_a_fresh_compile(tmp_path, monkeypatch):
    monkeypatch.delenv("DOMINO_IMAGE_REPOSITORY", raising=False)
    text, _, _ = _compile(tmp_path)
    with open(COMPILED_PATH, encoding="utf-8") as handle:
        committed = handle.read()
    assert text == committed, (
        "pipelines/gpt_pretrain.yaml is stale: run `domino pipeline compile` and commit the result")


def test_compilation_is_deterministic_across_processes(tmp_path):
    """Two fresh interpreters (different hash seeds) compile byte-identical files."""
    import subprocess
    import sys

    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / f"p{seed}.yaml"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        env.pop("DOMINO_IMAGE_REPOSITORY", None)
        subprocess.run([sys.executable, "-c", f"import pipelines; pipelines.compile_pipeline({str(out)!r})"],
                       check=True, env=env)
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]


def test_every_step_runs_the_image_without_installing_anything(tmp_path):
    _, spec, _ = _compile(tmp_path, image="registry.example/domino:test")
    executors = spec["deploymentSpec"]["executors"]
    assert sorted(executors) == sorted(STEPS)
    for name, executor in executors.items():
        container = executor["container"]
        assert container["image"] == "registry.example/domino:test", name
        script = " ".join(container["command"])
        assert "pip install" not in script, name
        assert "from components." in script, name  # the body delegates to the installed package


def test_image_defaults_to_env_then_release(monkeypatch, tmp_path):
    monkeypatch.delenv("DOMINO_IMAGE_REPOSITORY", raising=False)
    _, spec, _ = _compile(tmp_path)
    assert {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()} == {DEFAULT_IMAGE}
    monkeypatch.setenv("DOMINO_IMAGE_REPOSITORY", "other/domino")
    _, spec, _ = _compile(tmp_path)
    assert {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()} == {
        "other/domino:" + DEFAULT_IMAGE.split(":", 1)[1]}
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["image"]["defaultValue"] == ""  # the pretrain step picks the job's variant from its GPUs
    # ... in the repository chosen at compile time: the step's pod has no DOMINO_IMAGE_REPOSITORY of its own.
    env = spec["deploymentSpec"]["executors"]["exec-pretrain"]["container"]["env"]
    assert {"name": "DOMINO_IMAGE_REPOSITORY", "value": "other/domino"} in env


def test_structure_exit_handler_gate_and_no_caching(tmp_path):
    _, spec, _ = _compile(tmp_path)
    root_tasks = spec["root"]["dag"]["tasks"]
    assert root_tasks["cleanup-job"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    status_input = root_tasks["cleanup-job"]["inputs"]["parameters"]["status"]
    assert status_input["taskFinalStatus"]["producerTask"] == "exit-handler-1"
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert set(inner) == {"train-tokenizer", "plan-preprocess", "for-loop-2", "merge-datasets", "pretrain", "evaluate",
                          "condition-3"}
    # preprocessing and pretrain take the tokenizer that train-tokenizer trained (or passed on).
    for name in ("plan-preprocess", "pretrain"):
        source = inner[name]["inputs"]["parameters"]["tokenizer"]["taskOutputParameter"]
        assert source == {"outputParameterKey": "Output", "producerTask": "train-tokenizer"}, name
    assert "evaluate" in inner["condition-3"]["dependentTasks"]
    condition = inner["condition-3"]["triggerPolicy"]["condition"]
    assert "pipelinechannel--evaluate-Output" in condition and "true" in condition
    promote = spec["components"]["comp-condition-3"]["dag"]["tasks"]["promote-model"]
    artifacts = promote["inputs"]["artifacts"]
    assert artifacts["decision"]["componentInputArtifact"] == "pipelinechannel--evaluate-decision"
    assert artifacts["model"]["componentInputArtifact"] == "pipelinechannel--pretrain-model"
    assert promote["cachingOptions"] == {}
    for name in ("train-tokenizer", "plan-preprocess", "merge-datasets", "pretrain", "evaluate"):
        assert inner[name]["cachingOptions"] == {}, name  # {} = enableCache false
    # Every training step gets the per-run id from the placeholder (datasets are keyed by their inputs).
    for name in ("train-tokenizer", "pretrain", "evaluate"):
        assert inner[name]["inputs"]["parameters"]["run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"


def test_preprocess_fans_out_over_shard_groups_then_merges(tmp_path):
    _, spec, _ = _compile(tmp_path, preprocess_parallelism=3)
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    loop = inner["for-loop-2"]
    assert loop["iteratorPolicy"] == {"parallelismLimit": 3}
    assert loop["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--plan-preprocess-Output"
    assert loop["dependentTasks"] == ["plan-preprocess"] and loop["taskInfo"]["name"] == "shard-groups"
    assert inner["plan-preprocess"]["inputs"]["parameters"]["preprocess_groups"]["componentInputParameter"] == (
        "pipelinechannel--preprocess_groups")
    body = spec["components"]["comp-for-loop-2"]["dag"]["tasks"]
    assert set(body) == {"preprocess"} and body["preprocess"]["cachingOptions"] == {}
    assert body["preprocess"]["inputs"]["parameters"]["group"]["componentInputParameter"] == (
        "pipelinechannel--plan-preprocess-Output-loop-item")
    # dsl.Collected: the merge takes the list of every iteration's output, after the whole loop.
    merge = inner["merge-datasets"]
    assert merge["dependentTasks"] == ["for-loop-2"]
    assert merge["inputs"]["parameters"]["parts"]["taskOutputParameter"] == {
        "outputParameterKey": "pipelinechannel--preprocess-Output", "producerTask": "for-loop-2"}
    for consumer in ("pretrain", "evaluate"):
        assert inner[consumer]["inputs"]["artifacts"]["dataset"]["taskOutputArtifact"]["producerTask"] == (
            "merge-datasets")
    _, spec, _ = _compile(tmp_path)
    assert "iteratorPolicy" not in spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["for-loop-2"]


def test_platform_spec_mounts_the_pvc_everywhere_and_places_steps(tmp_path):
    placement = StepPlacement(node_selector={"pool": "cpu"},
                              tolerations=[{"key": "dedicated", "operator": "Equal", "value": "ml",
                                            "effect": "NoSchedule"}])
    _, _, platform = _compile(tmp_path, placement=placement)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert sorted(executors) == sorted(STEPS)
    for name, settings in executors.items():
        (mount,) = settings["pvcMount"]
        assert mount["mountPath"] == MOUNT_PATH, name
        assert mount["pvcNameParameter"]["componentInputParameter"].endswith("pvc_name"), name
        assert settings["nodeSelector"] == {"labels": {"pool": "cpu"}}, name
        assert settings["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                            "effect": "NoSchedule"}], name


def test_evaluate_step_can_get_gpus(tmp_path):
    _, spec, _ = _compile(tmp_path, placement=StepPlacement(eval_gpus=2))
    resources = spec["deploymentSpec"]["executors"]["exec-evaluate"]["container"]["resources"]
    assert resources["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert resources["accelerator"]["resourceCount"] == "2"
    _, spec, _ = _compile(tmp_path)
    assert "resources" not in spec["deploymentSpec"]["executors"]["exec-evaluate"]["container"]


def test_default_parameters_are_the_local_tiny_run():
    inputs = build_pipeline().component_spec.inputs
    assert inputs["preset"].default == "tiny"
    assert inputs["tensor_model_parallel_size"].default == 2
    assert inputs["domino_chunks"].default == -1  # not given: Domino's own choice, 2 chunks at TP 2
    assert inputs["shared_root"].default == MOUNT_PATH
    assert inputs["warm_start"].default is False


@pytest.mark.parametrize("function", ["train_tokenizer", "plan_preprocess", "preprocess", "merge_datasets",
                                      "pretrain", "evaluate", "promote_model", "cleanup_job"])
def test_every_component_compiles_on_its_own(function, tmp_path):
    from kfp import compiler

    from components import kfp_component, kfp_functions

    component = kfp_component(getattr(kfp_functions, function), "img:1")
    out = tmp_path / f"{function}.yaml"
    compiler.Compiler().compile(component, str(out))
    spec = yaml.safe_load(out.read_text())
    (executor,) = spec["deploymentSpec"]["executors"].values()
    assert executor["container"]["image"] == "img:1"


def test_every_step_runs_non_root_and_pretrain_retries_with_a_timeout(tmp_path):
    """kfp-kubernetes 2.17 ``set_security_context`` lands under platforms.kubernetes (runAsUser/Group/
    NonRoot; the backend adds no-privilege-escalation, drop ALL and RuntimeDefault seccomp itself); the
    pretrain task has a kfp retry policy (a retry adopts the run's job) and a pod deadline."""
    _, spec, platform = _compile(tmp_path)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name in STEPS:
        assert executors[name]["securityContext"] == {"runAsUser": "1000", "runAsGroup": "1000",
                                                      "runAsNonRoot": True}, name
    assert executors["exec-pretrain"]["activeDeadlineSeconds"] == str(7 * 24 * 3600)
    retry = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["pretrain"]["retryPolicy"]
    assert retry["maxRetryCount"] == 2 and retry["backoffDuration"] == "60s"
    envs = {e["name"] for e in executors["exec-pretrain"]["fieldPathAsEnv"]}
    assert envs == {"POD_NAME", "POD_UID", "POD_NAMESPACE"}  # the job goes to the step's namespace
    assert {e["name"] for e in executors["exec-cleanup-job"]["fieldPathAsEnv"]} == {"POD_NAMESPACE"}
