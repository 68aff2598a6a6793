"""The pods the Kubeflow training operator (v1.9) creates from a PyTorchJob, modelled from its source.

Read from kubeflow/trainer branch release-1.9 (= kubeflow/training-operator v1.9.x):

* ``pkg/controller.v1/common/pod.go`` ``createNewPod``: the pod is the replica's template plus the
  operator's labels, then ``SetClusterSpec`` (below), then ``core.SetRestartPolicy``
  (``pkg/core/pod.go``: ExitCode -> pod restartPolicy Never, otherwise the replica's policy).
* ``pkg/controller.v1/pytorch/pytorchjob_controller.go`` ``SetClusterSpec``: ``setPodEnv`` (envvar.go;
  only ``spec.containers`` get the variables) then ``setInitContainer``.
* ``pkg/controller.v1/pytorch/initcontainer.go`` ``setInitContainer``: only when the job has a Master,
  only for Worker pods, *appends* the containers parsed from the template to ``initContainers``. The
  template is read once from ``--pytorch-init-container-template-file`` (default
  ``/etc/config/initContainer.yaml``, ``pkg/config/config.go``); an unreadable file means the built-in
  template. It is executed with Go's ``html/template`` and fields ``InitContainerImage``
  (``--pytorch-init-container-image``, default ``alpine:3.10``), ``MasterAddr`` (``<job>-master-0``)
  and ``MaxTries`` (``--pytorch-init-container-max-tries``, default 100).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import yaml

DEFAULT_TEMPLATE_FILE = "/etc/config/initContainer.yaml"
DEFAULT_IMAGE = "alpine:3.10"
DEFAULT_MAX_TRIES = 100

#: The operator's built-in template (initcontainer.go ``initContainerTemplate``), as the containers it
#: yields: name, image, pull policy, resources and an nslookup loop; no securityContext.
BUILTIN_TEMPLATE = [{
    "name": "init-pytorch", "image": "{{.InitContainerImage}}", "imagePullPolicy": "IfNotPresent",
    "resources": {"limits": {"cpu": "100m", "memory": "20Mi"}, "requests": {"cpu": "50m", "memory": "10Mi"}},
    "command": ["sh", "-c", "err=1;for i in $(seq {{.MaxTries}}); do if nslookup {{.MasterAddr}}; then err=0 "
                "&& break; fi;echo waiting for master; sleep 2; done; exit $err"],
}]

# Go html/template escapes interpolated values in text context (html/template escape.go, htmlEscaper).
_HTML_ESCAPES = {"\0": "\ufffd", '"': "&#34;", "'": "&#39;", "&": "&amp;", "+": "&#43;", "<": "&lt;", ">": "&gt;"}
_ACTION = re.compile(r"{{\s*(.*?)\s*}}")


def execute_template(text: str, fields: Dict[str, Any]) -> str:
    """Go's ``template.Execute`` for templates made of ``{{.Field}}`` actions only (others raise)."""
    def substitute(match: "re.Match[str]") -> str:
        action = match.group(1)
        if not re.fullmatch(r"\.[A-Za-z]+", action) or action[1:] not in fields:
            raise ValueError(f"template action {{{{{action}}}}} is not modelled")
        return "".join(_HTML_ESCAPES.get(ch, ch) for ch in str(fields[action[1:]]))

    return _ACTION.sub(substitute, text)


@dataclass
class OperatorConfig:
    """The operator's init-container flags and the files its pod can read (path -> text)."""

    template_file: str = DEFAULT_TEMPLATE_FILE
    image: str = DEFAULT_IMAGE
    max_tries: int = DEFAULT_MAX_TRIES
    files: Optional[Dict[str, str]] = None

    @classmethod
    def from_manifests(cls, objects: List[Dict[str, Any]]) -> "OperatorConfig":
        """The configuration a built ``training-operator`` Deployment (+ its ConfigMaps) gives the operator:
        its flags (Go ``flag`` syntax ``--name=value``) and the ConfigMap files mounted into its container."""
        (deploy,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "training-operator"]
        pod = deploy["spec"]["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "training-operator"]
        flags = dict(arg.lstrip("-").split("=", 1) for arg in container.get("args") or [] if "=" in arg)
        config_maps = {o["metadata"]["name"]: o.get("data") or {} for o in objects if o["kind"] == "ConfigMap"}
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        files = {}
        for mount in container.get("volumeMounts") or []:
            source = volumes[mount["name"]].get("configMap")
            if source:
                for key, text in config_maps.get(source["name"], {}).items():
                    files[f"{mount['mountPath'].rstrip('/')}/{key}"] = text
        return cls(template_file=flags.get("pytorch-init-container-template-file", DEFAULT_TEMPLATE_FILE),
                   image=flags.get("pytorch-init-container-image", DEFAULT_IMAGE),
                   max_tries=int(flags.get("pytorch-init-container-max-tries", DEFAULT_MAX_TRIES)), files=files)

    def template(self) -> str:
        """``getInitContainerTemplateOrDefault``: the file's text if readable, else the built-in one."""
        text = (self.files or {}).get(self.template_file)
        return text if text is not None else yaml.safe_dump(BUILTIN_TEMPLATE)

    def init_containers(self, master_addr: str) -> List[Dict[str, Any]]:
        """``GetInitContainer``: the template executed and parsed as a list of containers."""
        text = execute_template(self.template(), {"InitContainerImage": self.image, "MasterAddr": master_addr,
                                                  "MaxTries": self.max_tries})
        return yaml.safe_load(text)


def operator_pods(job: Dict[str, Any], config: OperatorConfig) -> List[Dict[str, Any]]:
    """Every Pod object the operator creates for ``job`` (Master first, then Workers by index)."""
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    pods = []
    for rtype in ("Master", "Worker"):
        rspec = replicas.get(rtype)
        for index in range(rspec["replicas"] if rspec else 0):
            template = copy.deepcopy(rspec["template"])
            meta = template.get("metadata") or {}
            labels = {**(meta.get("labels") or {}), "training.kubeflow.org/job-name": name,
                      "training.kubeflow.org/operator-name": "pytorchjob-controller",
                      "training.kubeflow.org/replica-type": rtype.lower(),
                      "training.kubeflow.org/replica-index": str(index)}
            if rtype == "Master":
                labels["training.kubeflow.org/job-role"] = "master"
            spec = template["spec"]
            for container in spec["containers"]:  # setPodEnv: main containers only
                container.setdefault("env", []).append({"name": "PYTHONUNBUFFERED", "value": "1"})
            if "Master" in replicas and rtype == "Worker":  # setInitContainer
                spec["initContainers"] = (spec.get("initContainers") or []) + config.init_containers(
                    f"{name}-master-0")
            spec["restartPolicy"] = "Never" if rspec["restartPolicy"] == "ExitCode" else rspec["restartPolicy"]
            pods.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": f"{name}-{rtype.lower()}-{index}", "namespace": ns, "labels": labels,
                                      "annotations": meta.get("annotations") or {}},
                         "spec": spec})
    return pods
