"""Tolerations of a queued TrainJob, merged as Kubeflow Trainer v2.3.0 merges its runtime patches.

Modelled from the source:
- trainer v2.3.0 ``pkg/runtime/core/trainingruntime.go`` ``mergeRuntimePatches``: for each runtime patch in
  list order, ``strategicpatch.StrategicMergePatch(runtime JobSet spec, patch.trainingRuntimeSpec.template.spec,
  JobSetSpec{})``; the struct tags decide: ``replicatedJobs`` merge by ``name`` (jobset v0.12.0
  ``api/jobset/v1alpha2/jobset_types.go``), containers/volumes/env/imagePullSecrets/schedulingGates by
  ``name``, volumeMounts by ``mountPath``, and ``tolerations`` has no patch strategy (core/v1 ``PodSpec``),
  so a later patch's list replaces the earlier one (Kubernetes docs, "Update API Objects in Place Using kubectl
  patch": "the default patch strategy, which is replace");
- kueue v0.19.2 ``pkg/controller/jobs/trainjob/trainjob_webhook.go`` ``Default`` appends Kueue's patch
  (manager ``kueue.x-k8s.io/manager``) after the job's own; at admission ``trainjob_controller.go``
  ``RunWithPodSetsInfo`` fills it with the flavor's node labels and tolerations only
  (``pkg/podset/podset.go`` ``FromAssignment``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

import launch_scenarios as sc
from domino.launch import JobSpec, Toleration, defaults, trainjob
from domino.launch.check import ClusterCheck
from domino.launch.job_api import job_api
from fake_kube import FakeKubeServer
from k8s_schemas import schema_validator

REPO = Path(__file__).resolve().parents[2]
KUEUE_CRDS = REPO.parent / "shared/upstream/kueue-v0.19.2/components/crd/bases"
MERGE_KEYS = {"replicatedJobs": "name", "containers": "name", "initContainers": "name", "volumes": "name",
              "env": "name", "imagePullSecrets": "name", "schedulingGates": "name", "volumeMounts": "mountPath"}


def strategic_merge(original: Any, patch: Any, field: str = "") -> Any:
    """apimachinery's strategic merge for the fields above; every other list (tolerations) is replaced."""
    if isinstance(original, dict) and isinstance(patch, dict):
        out = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    if isinstance(original, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out = [copy.deepcopy(item) for item in original]
        for item in patch:
            at = next((i for i, o in enumerate(out) if o.get(key) == item.get(key)), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = strategic_merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def kueue_patch(flavor: Dict[str, Any]) -> Dict[str, Any]:
    """Kueue's runtime patch after admission to ``flavor`` (Go's omitempty drops empty fields)."""
    pod_spec = {k: v for k, v in (("nodeSelector", flavor["spec"].get("nodeLabels")),
                                  ("tolerations", flavor["spec"].get("tolerations"))) if v}
    return {"manager": "kueue.x-k8s.io/manager", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": pod_spec}}}}]}}}}


def admitted_pod_spec(spec: JobSpec, flavor: Dict[str, Any]) -> Dict[str, Any]:
    """The node pod spec of the JobSet the Trainer builds once Kueue admitted the TrainJob to ``flavor``."""
    runtime = yaml.safe_load((REPO / "k8s/trainer/trainingruntime.yaml").read_text())
    patches: List[Dict[str, Any]] = trainjob.render_trainjob(spec, "r")["spec"]["runtimePatches"] + [kueue_patch(flavor)]
    jobset = runtime["spec"]["template"]["spec"]
    for patch in patches:
        jobset = strategic_merge(jobset, patch["trainingRuntimeSpec"]["template"]["spec"])
    (node,) = jobset["replicatedJobs"]
    return node["template"]["spec"]["template"]["spec"]


def flavor(**spec) -> Dict[str, Any]:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "f"}, "spec": spec}


GPU = defaults.GPU_TOLERATION.to_dict()
QUEUED = JobSpec(name="gpt", image="i", nodes=2, gpus_per_node=8, nproc_per_node=8, queue="team-a")


def test_a_flavor_with_tolerations_replaces_the_jobs_gpu_toleration():
    """The issue's failure, reproduced: the strategic merge replaces the list with the flavor's."""
    dedicated = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    pod = admitted_pod_spec(QUEUED, flavor(nodeLabels={"pool": "gpu"}, tolerations=[dedicated]))
    assert pod["tolerations"] == [dedicated]
    assert pod["nodeSelector"] == {"pool": "gpu"}  # maps merge: the job's own selector would stay too
    # The merge is what the docs say for the other fields: volumes by name (the runtime's stay).
    assert {v["name"] for v in pod["volumes"]} >= {"domino-data", "dshm", "tmp", "home"}


def test_a_flavor_without_tolerations_leaves_the_jobs():
    pod = admitted_pod_spec(QUEUED, flavor(nodeLabels={"pool": "gpu"}))
    assert pod["tolerations"] == [GPU]


def test_the_shipped_gpu_flavor_is_valid_and_keeps_the_gpu_toleration():
    shipped = yaml.safe_load((REPO / "k8s/queue/resourceflavor-gpu.yaml").read_text())
    validator = schema_validator(KUEUE_CRDS / "kueue.x-k8s.io_resourceflavors.yaml", "v1beta2")
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(shipped)]
    assert not errors, errors
    assert GPU in shipped["spec"]["tolerations"]
    assert GPU in admitted_pod_spec(QUEUED, shipped)["tolerations"]
    # A toleration of the job's own that the flavor lacks is still replaced: it must be listed in the flavor.
    extra = Toleration.parse("dedicated=ml:NoSchedule")
    pod = admitted_pod_spec(JobSpec(**{**QUEUED.__dict__, "tolerations": [extra]}), shipped)
    assert extra.to_dict() not in pod["tolerations"] and GPU in pod["tolerations"]


DEDICATED = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        yield srv


def check_queued(server, **spec) -> List[str]:
    """``domino launch check --api trainjob --queue team-a``'s lines about ResourceFlavors."""
    lines = ClusterCheck(job_api("trainjob"), server.api_client()).run(
        sc.spec(namespace="domino", queue="team-a", **spec))
    return [line for line in lines if "ResourceFlavor" in line or "ClusterQueue" in line]


@pytest.mark.parametrize("tolerations, refused", [
    (None, False),  # nodeLabels only: Kueue's patch carries no tolerations, the job's stay
    ([DEDICATED], True),  # the case: the GPU toleration would be replaced
    ([DEDICATED, GPU], False),  # what k8s/queue/resourceflavor-gpu.yaml does
    ([{"operator": "Exists"}], False),  # tolerates every taint
])
def test_check_refuses_a_flavor_exactly_when_the_trainers_merge_drops_the_jobs_tolerations(server, tolerations,
                                                                                             refused):
    shape = {"nodeLabels": {"pool": "gpu"}, **({"tolerations": tolerations} if tolerations else {})}
    server.cluster.cluster_queues["cluster-queue"] = ["default-flavor", "gpu"]
    server.cluster.flavors["gpu"] = shape
    lines = check_queued(server)
    job = sc.spec(namespace="domino", queue="team-a")
    merged = admitted_pod_spec(job, flavor(**shape)).get("tolerations") or []
    universal = {"operator": "Exists"} in merged
    assert (GPU not in merged and not universal) == refused  # the merge model agrees with the case
    if refused:
        assert lines == [
            "ResourceFlavor gpu (ClusterQueue cluster-queue): its tolerations replace the TrainJob's when Kueue "
            "admits it there (trainer v2.3.0 mergeRuntimePatches), dropping nvidia.com/gpu:NoSchedule: add them to "
            "the flavor's spec.tolerations (as k8s/queue/resourceflavor-gpu.yaml does)"]
    else:
        assert lines == []
    assert ("kueue.x-k8s.io", "resourceflavors", "get") in server.cluster.verbs()


def test_check_names_the_jobs_own_toleration_and_a_read_it_is_refused(server):
    shipped = yaml.safe_load((REPO / "k8s/queue/resourceflavor-gpu.yaml").read_text())
    server.cluster.cluster_queues["cluster-queue"] = ["gpu"]
    server.cluster.flavors["gpu"] = shipped["spec"]
    assert check_queued(server) == []
    (line,) = check_queued(server, tolerations=[Toleration.parse("dedicated=ml:NoSchedule")])
    assert "dropping dedicated=ml:NoSchedule: add them" in line
    server.cluster.denied.add(("kueue.x-k8s.io", "clusterqueues", "get"))
    (line,) = check_queued(server)
    assert line.startswith("ClusterQueue cluster-queue: 403 Forbidden: ") and line.endswith(
        "cannot see its ResourceFlavors' tolerations (k8s/launch-check grants the read)")


def test_a_queued_pytorchjob_does_not_read_flavors(server):
    server.cluster.flavors["default-flavor"] = {"tolerations": [DEDICATED]}
    ClusterCheck(job_api("pytorchjob"), server.api_client()).run(sc.spec(namespace="domino", queue="team-a"))
    assert ("kueue.x-k8s.io", "resourceflavors", "get") not in server.cluster.verbs()
