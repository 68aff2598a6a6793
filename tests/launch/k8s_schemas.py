"""Offline validation helpers: the real PyTorchJob CRD schema, the operator webhook's rules, and the
Kubernetes core schemas (kubernetes-validate)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Dict, List

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO.parent / "shared/schemas/kubeflow.org_pytorchjobs.yaml"
#: Kubeflow Trainer v2.3.0's CRDs (TrainJob, TrainingRuntime, ClusterTrainingRuntime).
TRAINER_CRDS = REPO.parent / "shared/schemas/trainer-v2.3.0"
K8S_VERSION = "1.30.0"  # oldest Kubernetes the guide supports; kubernetes-validate ships its schema
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@functools.lru_cache(maxsize=None)
def schema_validator(path: Path, version_name: str) -> jsonschema.protocols.Validator:
    """A validator for the ``openAPIV3Schema`` of version ``version_name`` of the CRD in ``path``."""
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == version_name]
    schema = version["schema"]["openAPIV3Schema"]
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def crd_validator() -> jsonschema.protocols.Validator:
    return schema_validator(CRD_PATH, "v1")


def trainer_validator(plural: str) -> jsonschema.protocols.Validator:
    """The v2.3.0 schema of ``trainjobs``, ``trainingruntimes`` or ``clustertrainingruntimes``."""
    return schema_validator(TRAINER_CRDS / f"trainer.kubeflow.org_{plural}.yaml", "v1alpha1")


def validate_trainer_object(obj: Dict[str, Any], plural: str) -> None:
    """Raises AssertionError unless ``obj`` passes its Trainer v2.3.0 CRD schema."""
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in trainer_validator(plural).iter_errors(obj)]
    assert not errors, errors


def webhook_problems(job: Dict[str, Any]) -> List[str]:
    """The training operator's admission webhook rules for a PyTorchJob (v1.9)."""
    problems = []
    name = job["metadata"]["name"]
    if not DNS1035.match(name) or len(name) > 63:
        problems.append(f"name {name!r} is not DNS-1035")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    if set(replicas) - {"Master", "Worker"}:
        problems.append(f"unknown replica types {set(replicas)}")
    if "Master" not in replicas or replicas["Master"].get("replicas", 1) != 1:
        problems.append("there must be exactly one Master replica")
    for rtype, rspec in replicas.items():
        names = [c["name"] for c in rspec["template"]["spec"]["containers"]]
        if "pytorch" not in names:
            problems.append(f"{rtype}: no container named pytorch")
        count = rspec.get("replicas", 1)
        pods = [f"{name}-{rtype.lower()}-{i}" for i in range(count)]
        problems += [f"pod name {p!r} longer than 63" for p in pods if len(p) > 63]
    return problems


def validate_job(job: Dict[str, Any]) -> None:
    """Raises AssertionError unless ``job`` passes the CRD schema, the webhook rules and, for each
    replica's pod template, the Kubernetes Pod schema (strict: unknown fields are errors)."""
    errors = [e.message for e in crd_validator().iter_errors(job)]
    assert not errors, errors
    problems = webhook_problems(job)
    assert not problems, problems
    for rtype, rspec in job["spec"]["pytorchReplicaSpecs"].items():
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**rspec["template"]["metadata"], "name": f"{job['metadata']['name']}-{rtype.lower()}-0",
                            "namespace": job["metadata"]["namespace"]},
               "spec": rspec["template"]["spec"]}
        validate_core(pod)


def validate_core(obj: Dict[str, Any]) -> None:
    """Validates a core Kubernetes object offline (strict)."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
