"""The Pod Security Standards "restricted" profile (which includes "baseline") as an offline checker.

Each check mirrors one file of the admission plugin that enforces the standard,
kubernetes/kubernetes ``staging/src/k8s.io/pod-security-admission/policy/check_<id>.go`` (the
"restricted:latest" level of Kubernetes 1.30-1.34), documented in
https://kubernetes.io/docs/concepts/security/pod-security-standards/ . As in ``visitContainers``
(``policy/visitor.go``), every container rule applies to ``containers``, ``initContainers`` and
``ephemeralContainers`` alike. Linux pods only (the Windows relaxations are not modelled).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Tuple

Pod = Dict[str, Any]

#: check_capabilities_baseline.go: what baseline lets a container add.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
#: check_sysctls.go (1.29 list): the "safe" sysctls.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
#: check_seLinuxOptions.go: allowed SELinux types.
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
#: check_restrictedVolumes.go: the only volume sources restricted allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def containers(spec: Pod) -> Iterator[Dict[str, Any]]:
    """policy/visitor.go ``visitContainers``: containers, init containers, ephemeral containers."""
    for key in ("containers", "initContainers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _sc(obj: Dict[str, Any]) -> Dict[str, Any]:
    return obj.get("securityContext") or {}


def _bad(names: List[str], why: str) -> List[str]:
    return [f"{name}: {why}" for name in names]


# -- baseline -------------------------------------------------------------------------------------------
def host_process(spec: Pod) -> List[str]:  # check_windowsHostProcess.go
    out = ["pod: windowsOptions.hostProcess" for _ in [0] if (_sc(spec).get("windowsOptions") or {}).get("hostProcess")]
    return out + _bad([c["name"] for c in containers(spec) if (_sc(c).get("windowsOptions") or {}).get("hostProcess")],
                      "windowsOptions.hostProcess=true")


def host_namespaces(spec: Pod) -> List[str]:  # check_hostNamespaces.go
    return [f"pod: {key}=true" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]


def privileged(spec: Pod) -> List[str]:  # check_privileged.go
    return _bad([c["name"] for c in containers(spec) if _sc(c).get("privileged")], "privileged=true")


def capabilities_baseline(spec: Pod) -> List[str]:  # check_capabilities_baseline.go
    return _bad([c["name"] for c in containers(spec)
                 if set((_sc(c).get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES],
                "adds capabilities beyond the baseline set")


def host_path_volumes(spec: Pod) -> List[str]:  # check_hostPathVolumes.go
    return [f"volume {v['name']}: hostPath" for v in spec.get("volumes") or [] if "hostPath" in v]


def host_ports(spec: Pod) -> List[str]:  # check_hostPorts.go
    return _bad([c["name"] for c in containers(spec) if any(p.get("hostPort") for p in c.get("ports") or [])],
                "hostPort set")


def app_armor(spec: Pod, annotations: Dict[str, str]) -> List[str]:  # check_appArmorProfile.go
    out = [f"annotation {k}={v}" for k, v in annotations.items()
           if k.startswith("container.apparmor.security.beta.kubernetes.io/")
           and not (v == "runtime/default" or v.startswith("localhost/"))]
    for name, sc in [("pod", _sc(spec))] + [(c["name"], _sc(c)) for c in containers(spec)]:
        kind = (sc.get("appArmorProfile") or {}).get("type")
        if kind is not None and kind not in SECCOMP_OK:
            out.append(f"{name}: appArmorProfile.type={kind}")
    return out


def se_linux(spec: Pod) -> List[str]:  # check_seLinuxOptions.go
    out = []
    for name, sc in [("pod", _sc(spec))] + [(c["name"], _sc(c)) for c in containers(spec)]:
        opts = sc.get("seLinuxOptions") or {}
        if opts.get("type", "") not in SELINUX_TYPES or opts.get("user") or opts.get("role"):
            out.append(f"{name}: seLinuxOptions {opts}")
    return out


def proc_mount(spec: Pod) -> List[str]:  # check_procMount.go
    return _bad([c["name"] for c in containers(spec) if _sc(c).get("procMount", "Default") != "Default"],
                "procMount is not Default")


def seccomp_baseline(spec: Pod) -> List[str]:  # check_seccompProfile_baseline.go
    out = []
    for name, sc in [("pod", _sc(spec))] + [(c["name"], _sc(c)) for c in containers(spec)]:
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{name}: seccompProfile Unconfined")
    return out


def sysctls(spec: Pod) -> List[str]:  # check_sysctls.go
    return [f"pod: sysctl {s['name']}" for s in _sc(spec).get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]


def host_probes(spec: Pod) -> List[str]:  # check_hostProbesAndhostLifecycle.go (1.34)
    out = []
    for c in containers(spec):
        handlers = [c.get(p) or {} for p in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += list((c.get("lifecycle") or {}).values())
        for handler in handlers:
            if any((handler.get(kind) or {}).get("host") for kind in ("httpGet", "tcpSocket")):
                out.append(f"{c['name']}: probe or lifecycle handler sets host")
    return out


# -- restricted -----------------------------------------------------------------------------------------
def restricted_volumes(spec: Pod) -> List[str]:  # check_restrictedVolumes.go
    return [f"volume {v['name']}: type {set(v) - {'name'}} not allowed" for v in spec.get("volumes") or []
            if not (set(v) - {"name"}) & RESTRICTED_VOLUMES]


def allow_privilege_escalation(spec: Pod) -> List[str]:  # check_allowPrivilegeEscalation.go
    return _bad([c["name"] for c in containers(spec) if _sc(c).get("allowPrivilegeEscalation") is not False],
                "must set securityContext.allowPrivilegeEscalation=false")


def run_as_non_root(spec: Pod) -> List[str]:  # check_runAsNonRoot.go
    pod_value = _sc(spec).get("runAsNonRoot")
    out = ["pod: runAsNonRoot=false"] if pod_value is False else []
    for c in containers(spec):
        value = _sc(c).get("runAsNonRoot")
        if value is False or (value is None and pod_value is not True):
            out.append(f"{c['name']}: pod or container must set securityContext.runAsNonRoot=true")
    return out


def run_as_user(spec: Pod) -> List[str]:  # check_runAsUser.go
    out = ["pod: runAsUser=0"] if _sc(spec).get("runAsUser") == 0 else []
    return out + _bad([c["name"] for c in containers(spec) if _sc(c).get("runAsUser") == 0], "runAsUser=0")


def seccomp_restricted(spec: Pod) -> List[str]:  # check_seccompProfile_restricted.go
    pod_type = (_sc(spec).get("seccompProfile") or {}).get("type")
    out = [f"pod: seccompProfile.type={pod_type}"] if pod_type is not None and pod_type not in SECCOMP_OK else []
    for c in containers(spec):
        kind = (_sc(c).get("seccompProfile") or {}).get("type")
        if (kind is None and pod_type not in SECCOMP_OK) or (kind is not None and kind not in SECCOMP_OK):
            out.append(f"{c['name']}: pod or container must set seccompProfile.type to RuntimeDefault or Localhost")
    return out


def capabilities_restricted(spec: Pod) -> List[str]:  # check_capabilities_restricted.go
    out = []
    for c in containers(spec):
        caps = _sc(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f'{c["name"]}: must set securityContext.capabilities.drop=["ALL"]')
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{c['name']}: may add only NET_BIND_SERVICE")
    return out


CHECKS: List[Tuple[str, Callable[[Pod], List[str]]]] = [
    ("hostProcess", host_process), ("hostNamespaces", host_namespaces), ("privileged", privileged),
    ("capabilities_baseline", capabilities_baseline), ("hostPathVolumes", host_path_volumes),
    ("hostPorts", host_ports), ("seLinuxOptions", se_linux), ("procMount", proc_mount),
    ("seccompProfile_baseline", seccomp_baseline), ("sysctls", sysctls), ("hostProbes", host_probes),
    ("restrictedVolumes", restricted_volumes), ("allowPrivilegeEscalation", allow_privilege_escalation),
    ("runAsNonRoot", run_as_non_root), ("runAsUser", run_as_user), ("seccompProfile_restricted", seccomp_restricted),
    ("capabilities_restricted", capabilities_restricted),
]


def restricted_violations(pod: Pod) -> List[str]:
    """Every violation of the restricted profile by a Pod object, as ``check: detail``; [] = admitted."""
    spec = pod["spec"]
    out = [f"appArmorProfile: {v}" for v in app_armor(spec, (pod.get("metadata") or {}).get("annotations") or {})]
    for check_id, check in CHECKS:
        out += [f"{check_id}: {v}" for v in check(spec)]
    return out


#: The checks of the baseline profile (the rest of CHECKS are restricted's additions).
BASELINE_CHECK_IDS = ("hostProcess", "hostNamespaces", "privileged", "capabilities_baseline", "hostPathVolumes",
                      "hostPorts", "seLinuxOptions", "procMount", "seccompProfile_baseline", "sysctls", "hostProbes")


def baseline_violations(pod: Pod) -> List[str]:
    """Every violation of the baseline profile by a Pod object, as ``check: detail``; [] = admitted."""
    return [v for v in restricted_violations(pod)
            if v.split(":", 1)[0] in BASELINE_CHECK_IDS + ("appArmorProfile",)]
