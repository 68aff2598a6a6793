"""``--api trainjob``: a Kubeflow Trainer v2 TrainJob valid against the real v2.3.0 CRD, refusing what it cannot carry."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from domino.cli.main import main as domino_main
from domino.launch import JobSpec, LaunchSpecError, Toleration, naming
from domino.launch.job_api import JOB_APIS, job_api
from domino.launch.trainjob import RESERVED_ENV, render_trainjob
from k8s_schemas import DNS1035, trainer_validator, validate_trainer_object

REPO = Path(__file__).resolve().parents[2]
RUNTIME = yaml.safe_load((REPO / "k8s" / "trainer" / "trainingruntime.yaml").read_text())
BASE = dict(name="gpt", image="registry.example/domino:1.0", pretrain_args=["--preset", "tiny"])
DONE_WHEN = ["launch", "render", "--api", "trainjob", "--name", "gpt", "--image", "img:1", "--run-id", "abc",
             "--nodes", "4", "--nproc-per-node", "8", "--gpus-per-node", "8", "--pvc", "domino-data", "--",
             "--preset", "tiny", "--train-iters", "4", "--mock-data"]


def _render_cli(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        domino_main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out


def _node_patch(job):
    (patch,) = job["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    return node["template"]["spec"]["template"]


def test_cli_renders_the_issues_four_by_eight_trainjob(capsys):
    code, out = _render_cli(DONE_WHEN, capsys)
    assert code == 0, out.err
    job = yaml.safe_load(out.out)
    validate_trainer_object(job, "trainjobs")
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["metadata"]["name"] == "gpt-abc" and DNS1035.match(job["metadata"]["name"])
    # The runtime the job refers to is the one k8s/trainer ships, and it mounts the claim asked for.
    ref = job["spec"]["runtimeRef"]
    assert (ref["kind"], ref["name"]) == (RUNTIME["kind"], RUNTIME["metadata"]["name"])
    pod = RUNTIME["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {"persistentVolumeClaim": {"claimName": "domino-data"}, "name": "domino-data"} in pod["volumes"]
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 4 and trainer["numProcPerNode"] == 8 and trainer["image"] == "img:1"
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8"}
    assert trainer["resourcesPerNode"]["requests"] == {"cpu": "32", "memory": "128Gi", "nvidia.com/gpu": "8"}
    assert trainer["command"][5:14] == ["torchrun", "-m", "domino", "pretrain", "--preset", "tiny", "--train-iters",
                                       "4", "--mock-data"]
    assert trainer["command"][trainer["command"].index("--save") + 1] == "/mnt/domino/checkpoints/gpt-abc"
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env["DOMINO_JOB_NAME"] == "gpt-abc" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert not set(env) & set(RESERVED_ENV)
    template = _node_patch(job)
    assert template["metadata"]["labels"][naming.RUN_ID_LABEL] == "abc"
    assert template["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "domino-launch"
    assert template["spec"]["terminationGracePeriodSeconds"] == 180
    assert job["metadata"]["annotations"][naming.RUN_ID_ANNOTATION] == "abc"
    assert "suspend" not in job["spec"]


def test_the_default_api_stays_pytorchjob_and_one_table_chooses_the_renderer(capsys):
    argv = [a for a in DONE_WHEN if a not in ("--api", "trainjob")]
    code, out = _render_cli(argv, capsys)
    assert code == 0 and yaml.safe_load(out.out)["kind"] == "PyTorchJob"
    spec = JobSpec(**{**BASE, "nodes": 2})
    for name, api in JOB_APIS.items():
        obj = api.render(spec, "r1", None)
        assert obj["kind"] == api.kind and obj["apiVersion"] == f"{api.group}/{api.version}", name
    with pytest.raises(ValueError, match="--api: 'mpijob' is not one of pytorchjob, trainjob"):
        job_api("mpijob")


VARIANTS = {
    "cpu-one-node": dict(),
    "auto-procs": dict(nodes=64, nproc_per_node="auto", gpus_per_node=8),
    "scheduling": dict(nodes=2, node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                       tolerations=[Toleration.parse("nvidia.com/gpu:NoSchedule")], image_pull_secrets=["regcred"],
                       service_account="domino-trainer", active_deadline_seconds=7200,
                       cpu_limit="48", memory_limit="400Gi"),
    "meta": dict(env={"NCCL_DEBUG": "INFO"}, labels={"team": "nlp"}, annotations={"example.com/note": "x: y"},
                 owner="alice"),
    "command": dict(command=["torchrun", "-m", "domino.launch.envcheck", "--out", "/mnt/domino/envcheck"]),
    "long-name": dict(name="a" * 40, nodes=1000),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_validates_against_the_v2_3_crd(variant):
    job = render_trainjob(JobSpec(**{**BASE, **VARIANTS[variant]}), run_id="0f8fad5b-d9cb-469f-a165-70867728950e")
    validate_trainer_object(job, "trainjobs")
    assert len(job["metadata"]["name"]) <= 63 and DNS1035.match(job["metadata"]["name"])


def test_auto_leaves_num_proc_per_node_to_the_torch_plugin_and_patches_carry_pod_settings():
    job = render_trainjob(JobSpec(**{**BASE, **VARIANTS["auto-procs"]}), run_id="r1")
    assert "numProcPerNode" not in job["spec"]["trainer"]
    job = render_trainjob(JobSpec(**{**BASE, **VARIANTS["scheduling"]}), run_id="r1")
    pod = _node_patch(job)["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["serviceAccountName"] == "domino-trainer" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert job["spec"]["activeDeadlineSeconds"] == 7200
    assert job["spec"]["trainer"]["resourcesPerNode"]["limits"] == {"cpu": "48", "memory": "400Gi"}


def test_queue_labels_the_trainjob_for_kueue_and_leaves_suspending_it_to_kueue():
    job = render_trainjob(JobSpec(**{**BASE, "nodes": 2, "queue": "team-gpus"}), run_id="r1")
    validate_trainer_object(job, "trainjobs")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-gpus"
    assert "suspend" not in job["spec"]  # Kueue's webhook sets it (tests/launch/test_launch_kueue.py)


@pytest.mark.parametrize("field,value,flag", [
    ("nproc_per_node", "gpu", "--nproc-per-node"), ("priority_class", "high", "--priority-class"),
    ("restart_policy", "ExitCode", "--restart-policy"), ("backoff_limit", 2, "--backoff-limit"),
    ("clean_pod_policy", "All", "--clean-pod-policy"), ("scheduling_policy", True, "--scheduling-policy"),
    ("env", {"PET_NNODES": "2"}, "--env"), ("env_from_secrets", ["mlflow-credentials"], "--env-from-secret"),
])
def test_what_a_trainjob_cannot_carry_is_refused_naming_the_flag(field, value, flag):
    spec = JobSpec(**{**BASE, "gpus_per_node": 1, field: value})
    spec.validate()  # fine for a PyTorchJob
    with pytest.raises(LaunchSpecError, match=f"--api trainjob: {flag}"):
        render_trainjob(spec, run_id="r1")


def test_a_queued_trainjob_refuses_a_grace_period_kueue_would_drop():
    spec = JobSpec(**{**BASE, "queue": "team-a", "termination_grace_period_s": 600})
    with pytest.raises(LaunchSpecError, match="--termination-grace-period: Kueue v0.19.2 drops"):
        render_trainjob(spec, run_id="r1")
    render_trainjob(JobSpec(**{**BASE, "termination_grace_period_s": 600}), run_id="r1")  # unqueued: the patch's
    render_trainjob(JobSpec(**{**BASE, "queue": "team-a"}), run_id="r1")  # queued, the runtime's value


def test_cli_refusal_is_one_line_and_exit_code_2(capsys):
    cut = DONE_WHEN.index("--")
    code, out = _render_cli(DONE_WHEN[:cut] + ["--priority-class", "high"] + DONE_WHEN[cut:], capsys)
    assert code == 2 and out.out == ""
    assert out.err.strip().endswith("--priority-class: runtime patches cannot set priorityClassName")


def test_the_crd_check_rejects_broken_trainjobs():
    job = render_trainjob(JobSpec(**{**BASE, "nproc_per_node": 2}), run_id="r1")
    for mutate in (lambda j: j["spec"]["trainer"].update(numProcPerNode="auto"),  # int32 in v2.3.0
                   lambda j: j["spec"].pop("runtimeRef"),
                   lambda j: j["spec"]["runtimePatches"][0].pop("manager"),
                   lambda j: j["spec"].update(activeDeadlineSeconds=0)):
        bad = copy.deepcopy(job)
        mutate(bad)
        assert list(trainer_validator("trainjobs").iter_errors(bad))


def test_rendering_a_trainjob_imports_neither_torch_nor_kubernetes():
    code = ("import sys; from domino.launch.trainjob import render_trainjob; from domino.launch import JobSpec; "
            "render_trainjob(JobSpec(name='a', image='b'), 'r'); "
            "bad = [m for m in ('torch', 'kubernetes') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_local_node_env_sets_exactly_the_variables_the_plugin_reserves():
    """torch.go injects the TorchRunReservedEnvNames (constants.go) that Validate refuses in trainer.env."""
    api = job_api("trainjob")
    spec = JobSpec(**{**BASE, "nodes": 2, "nproc_per_node": 4, "gpus_per_node": 4})
    env = api.node_env(spec, "gpt-r", 1, 31000)
    # PET_RDZV_CONF is domino's own (torchrun's rendezvous timeout), not in TorchRunReservedEnvNames.
    assert {k for k in env if k.startswith("PET_")} == set(RESERVED_ENV) | {"PET_RDZV_CONF"}
    assert env["PET_NPROC_PER_NODE"] == "4" and env["PET_NODE_RANK"] == env["JOB_COMPLETION_INDEX"] == "1"
    # auto with GPUs stays auto (torchrun counts them); without GPUs it becomes the CPU request (1 per process).
    assert api.node_env(JobSpec(**{**BASE, "nproc_per_node": "auto", "gpus_per_node": 8}), "g", 0, 1)[
        "PET_NPROC_PER_NODE"] == "auto"
    assert api.node_env(JobSpec(**{**BASE, "nproc_per_node": "auto", "cpu_limit": "3"}), "g", 0, 1)[
        "PET_NPROC_PER_NODE"] == "1"  # the request (1, from defaults) wins over the limit


def test_a_trainjob_reads_secret_env_through_the_trainer_env():
    """trainer.env takes valueFrom (the v2.3.0 CRD's EnvVar), so --env-secret works for a TrainJob too."""
    spec = JobSpec(**{**BASE, "secret_env": {"HF_TOKEN": "hf-credentials:token"}})
    job = render_trainjob(spec, run_id="r1")
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}} in \
        job["spec"]["trainer"]["env"]
    validate_trainer_object(job, "trainjobs")
