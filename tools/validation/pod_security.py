"""Pod Security admission, offline: the `baseline` and `restricted` checks the API server runs on every pod.

Usage:
    from tools.validation import pod_security
    pod_security.evaluate(pod, "baseline")            # -> [Violation(check, reason, fields), ...]; [] = admitted
    pod_security.evaluate(pod, "restricted", "1.33")  # the checks as of that Kubernetes minor
    pod_security.pod_templates(obj)                   # the pods a Deployment, DaemonSet, JobSet, ... would create
    pod_security.skeleton(pod)                        # only the fields these checks read (chart snapshots record it)

`pod` is a mapping with `metadata` and `spec`, as a Pod or a workload's pod template has them.

A port of the checks of k8s.io/pod-security-admission (https://github.com/kubernetes/pod-security-admission,
policy/check_*.go at tag v0.33.9, the library of Kubernetes 1.33): each function below is named after the
check it follows and keeps its rules, its versions (the newest version at or below the minor asked for
applies) and its overrides (`restricted`'s capabilities, volumes and seccomp checks replace baseline's).
No evaluator of these rules installs offline (the library is Go, run inside the API server), so they are
written here; tests/tools/validation/test_pod_security.py runs them over the library's own fixtures
(test/testdata/{baseline,restricted}/v1.32, the newest the tag has: no check changes after 1.32) and
requires each `fail` fixture to fail the check it is named after and each `pass` fixture to pass.
Not followed: the opt-in relaxation for user-namespace pods (RelaxPolicyForUserNamespacePods, off by
default) and the checks' versions before 1.25 (no stack runs an older minor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

LEVELS = ("privileged", "baseline", "restricted")
CONTAINER_KINDS = ("initContainers", "containers", "ephemeralContainers")
# kind -> path from the object to its pod template ("*" fans out over a list); policies/pods.py has the same.
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
    "JobSet": ("spec", "replicatedJobs", "*", "template", "spec", "template"),
}
# check_capabilities_baseline.go: the container runtime's default set.
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# check_sysctls.go, by the minor that added them.
_SYSCTLS = ((0, {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
                 "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start"}),
            (27, {"net.ipv4.ip_local_reserved_ports"}),
            (29, {"net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                  "net.ipv4.tcp_keepalive_probes"}),
            (32, {"net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}))
# check_restrictedVolumes.go: the inline volume sources `restricted` allows.
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image",
                                "persistentVolumeClaim", "projected", "secret"})
_VOLUME_META = frozenset({"name"})


@dataclass(frozen=True)
class Violation:
    check: str  # the upstream check ID (hostNamespaces, hostPathVolumes, capabilities_baseline, ...)
    level: str  # the level the check belongs to
    reason: str  # what is forbidden
    fields: tuple[str, ...]  # the offending fields, as paths in the pod

    def __str__(self) -> str:
        return f"{self.check}: {self.reason} ({', '.join(self.fields)})"


def _minor(version: str) -> int:
    parts = str(version).lstrip("v").split(".")
    if parts[0] != "1" or len(parts) < 2 or not parts[1].isdigit():
        raise ValueError(f"Kubernetes version {version!r} is not 1.<minor>")
    if int(parts[1]) < 25:
        raise ValueError(f"Kubernetes {version}: the checks are ported for 1.25 and later")
    return int(parts[1])


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """visitor.go visitContainers: init, regular and ephemeral containers, each with its field path."""
    for kind in CONTAINER_KINDS:
        for c in spec.get(kind) or []:
            yield f"spec.{kind}[{c.get('name')}]", c


def _sc(c: Mapping[str, Any]) -> Mapping[str, Any]:
    return c.get("securityContext") or {}


def _windows(spec: Mapping[str, Any]) -> bool:
    return ((spec.get("os") or {}).get("name")) == "windows"


# --------------------------------------------------------------------------------------------- baseline

def host_namespaces(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    return [f"spec.{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k) is True]


def privileged(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    return [f"{w}.securityContext.privileged=true" for w, c in _containers(spec) if _sc(c).get("privileged") is True]


def capabilities_baseline(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    out = []
    for w, c in _containers(spec):
        added = [str(a) for a in ((_sc(c).get("capabilities") or {}).get("add") or [])]
        bad = [a for a in added if a not in BASELINE_CAPABILITIES]
        if bad:
            out.append(f"{w}.securityContext.capabilities.add={bad}")
    return out


def host_path_volumes(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    return [f"spec.volumes[{v.get('name')}].hostPath={(v.get('hostPath') or {}).get('path')}"
            for v in spec.get("volumes") or [] if v.get("hostPath") is not None]


def host_ports(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    return [f"{w}.ports[{p.get('name') or p.get('containerPort')}].hostPort={p['hostPort']}"
            for w, c in _containers(spec) for p in c.get("ports") or [] if p.get("hostPort")]


def _bad_profiles(spec: Mapping[str, Any], field: str) -> list[str]:
    """The pod's and each container's `field` (appArmorProfile, seccompProfile) whose type is neither RuntimeDefault
    nor Localhost."""
    scs = [("spec", spec.get("securityContext") or {}), *((w, _sc(c)) for w, c in _containers(spec))]
    return [f"{w}.securityContext.{field}.type={prof.get('type')}" for w, sc in scs
            if (prof := sc.get(field)) is not None and prof.get("type") not in ("RuntimeDefault", "Localhost")]


def app_armor_profile(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    out = _bad_profiles(spec, "appArmorProfile")
    for k, v in sorted((meta.get("annotations") or {}).items()):
        if k.startswith("container.apparmor.security.beta.kubernetes.io/") and v and v != "runtime/default" \
                and not str(v).startswith("localhost/"):
            out.append(f"metadata.annotations[{k}]={v}")
    return out


def se_linux_options(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    types = {"", "container_t", "container_init_t", "container_kvm_t"} | ({"container_engine_t"} if minor >= 31 else set())

    def bad(where: str, opts: Mapping[str, Any] | None) -> list[str]:
        if opts is None:
            return []
        found = [f"{where}.seLinuxOptions.type={opts.get('type')}"] if (opts.get("type") or "") not in types else []
        return found + [f"{where}.seLinuxOptions.{k}" for k in ("user", "role") if opts.get(k)]

    out = bad("spec.securityContext", (spec.get("securityContext") or {}).get("seLinuxOptions"))
    for w, c in _containers(spec):
        out += bad(f"{w}.securityContext", _sc(c).get("seLinuxOptions"))
    return out


def proc_mount(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    return [f"{w}.securityContext.procMount={_sc(c)['procMount']}" for w, c in _containers(spec)
            if _sc(c).get("procMount") not in (None, "Default")]


def seccomp_profile_baseline(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    return _bad_profiles(spec, "seccompProfile")


def sysctls(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    allowed = set().union(*(names for since, names in _SYSCTLS if minor >= since))
    return [f"spec.securityContext.sysctls[{s.get('name')}]"
            for s in (spec.get("securityContext") or {}).get("sysctls") or [] if s.get("name") not in allowed]


def windows_host_process(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    out = []
    if ((spec.get("securityContext") or {}).get("windowsOptions") or {}).get("hostProcess") is True:
        out.append("spec.securityContext.windowsOptions.hostProcess=true")
    return out + [f"{w}.securityContext.windowsOptions.hostProcess=true" for w, c in _containers(spec)
                  if (_sc(c).get("windowsOptions") or {}).get("hostProcess") is True]


# ------------------------------------------------------------------------------------------- restricted

def allow_privilege_escalation(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    if _windows(spec):
        return []
    return [f"{w}.securityContext.allowPrivilegeEscalation={_sc(c).get('allowPrivilegeEscalation')}"
            for w, c in _containers(spec) if _sc(c).get("allowPrivilegeEscalation") is not False]


def capabilities_restricted(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    if _windows(spec):
        return []
    out = []
    for w, c in _containers(spec):
        caps = _sc(c).get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{w}.securityContext.capabilities.drop lacks ALL")
        bad = [str(a) for a in caps.get("add") or [] if a != "NET_BIND_SERVICE"]
        if bad:
            out.append(f"{w}.securityContext.capabilities.add={bad}")
    return out


def restricted_volumes(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    out = []
    for v in spec.get("volumes") or []:
        sources = [k for k, val in v.items() if k not in _VOLUME_META and val is not None]
        # A volume that names no source is an emptyDir: the API server defaults it before admission
        # (SetDefaults_Volume, kubernetes pkg/apis/core/v1/defaults.go).
        if sources and not any(k in RESTRICTED_VOLUMES for k in sources):
            out.append(f"spec.volumes[{v.get('name')}].{sources[0] if sources else 'unknown'}")
    return out


def run_as_non_root(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    pod = (spec.get("securityContext") or {}).get("runAsNonRoot")
    out = ["spec.securityContext.runAsNonRoot=false"] if pod is False else []
    for w, c in _containers(spec):
        own = _sc(c).get("runAsNonRoot")
        if own is False or (own is None and pod is not True):
            out.append(f"{w}.securityContext.runAsNonRoot={own}")
    return out


def run_as_user(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    out = ["spec.securityContext.runAsUser=0"] if (spec.get("securityContext") or {}).get("runAsUser") == 0 else []
    return out + [f"{w}.securityContext.runAsUser=0" for w, c in _containers(spec) if _sc(c).get("runAsUser") == 0]


def seccomp_profile_restricted(meta: Mapping[str, Any], spec: Mapping[str, Any], minor: int) -> list[str]:
    if _windows(spec):
        return []
    ok = ("RuntimeDefault", "Localhost")
    pod = (spec.get("securityContext") or {}).get("seccompProfile")
    out = [f"spec.securityContext.seccompProfile.type={pod.get('type')}"] if pod is not None and pod.get(
        "type") not in ok else []
    pod_set = pod is not None and pod.get("type") in ok
    for w, c in _containers(spec):
        prof = _sc(c).get("seccompProfile")
        if prof is not None and prof.get("type") not in ok:
            out.append(f"{w}.securityContext.seccompProfile.type={prof.get('type')}")
        elif prof is None and not pod_set:
            out.append(f"{w}.securityContext.seccompProfile unset")
    return out


Check = Callable[[Mapping[str, Any], Mapping[str, Any], int], list[str]]
# (check ID, level, what it forbids, function, IDs of the checks it replaces)
CHECKS: tuple[tuple[str, str, str, Check, tuple[str, ...]], ...] = (
    ("hostNamespaces", "baseline", "host namespaces", host_namespaces, ()),
    ("privileged", "baseline", "privileged containers", privileged, ()),
    ("capabilities_baseline", "baseline", "capabilities beyond the default set", capabilities_baseline, ()),
    ("hostPathVolumes", "baseline", "hostPath volumes", host_path_volumes, ()),
    ("hostPorts", "baseline", "host ports", host_ports, ()),
    ("appArmorProfile", "baseline", "AppArmor profile other than the default", app_armor_profile, ()),
    ("seLinuxOptions", "baseline", "SELinux options", se_linux_options, ()),
    ("procMount", "baseline", "unmasked /proc", proc_mount, ()),
    ("seccompProfile_baseline", "baseline", "seccomp profile Unconfined", seccomp_profile_baseline, ()),
    ("sysctls", "baseline", "unsafe sysctls", sysctls, ()),
    ("windowsHostProcess", "baseline", "Windows host processes", windows_host_process, ()),
    ("allowPrivilegeEscalation", "restricted", "privilege escalation allowed", allow_privilege_escalation, ()),
    ("capabilities_restricted", "restricted", "capabilities not dropped or added", capabilities_restricted,
     ("capabilities_baseline",)),
    ("restrictedVolumes", "restricted", "volume types other than the restricted set", restricted_volumes,
     ("hostPathVolumes",)),
    ("runAsNonRoot", "restricted", "running as root allowed", run_as_non_root, ()),
    ("runAsUser", "restricted", "runAsUser 0", run_as_user, ()),
    ("seccompProfile_restricted", "restricted", "no RuntimeDefault or Localhost seccomp profile",
     seccomp_profile_restricted, ("seccompProfile_baseline",)),
)


def evaluate(pod: Mapping[str, Any], level: str, version: str = "1.33") -> list[Violation]:
    """What Pod Security admission at `level` refuses in this pod; empty when the pod is admitted."""
    if level not in LEVELS:
        raise ValueError(f"unknown Pod Security level {level!r} (one of {', '.join(LEVELS)})")
    minor = _minor(version)
    if level == "privileged":
        return []
    wanted = [c for c in CHECKS if c[1] == "baseline" or level == "restricted"]
    replaced = {r for c in wanted for r in c[4]}
    meta, spec = pod.get("metadata") or {}, _defaulted(pod.get("spec") or {})
    out = []
    for check_id, check_level, reason, fn, _ in wanted:
        if check_id in replaced:
            continue
        fields = fn(meta, spec, minor)
        if fields:
            out.append(Violation(check_id, check_level, reason, tuple(fields)))
    return out


def _defaulted(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """The defaulting the API server applies to a Pod before admission that these checks can see: a pod on the
    host network gets hostPort = containerPort on every port that sets none (defaultHostNetworkPorts,
    kubernetes pkg/apis/core/v1/defaults.go SetDefaults_Pod)."""
    if spec.get("hostNetwork") is not True:
        return spec
    out = dict(spec)
    for kind in ("initContainers", "containers"):
        if spec.get(kind):
            out[kind] = [{**c, "ports": [{**p, "hostPort": p.get("hostPort") or p.get("containerPort")}
                                         for p in c.get("ports") or []]} if c.get("ports") else c
                         for c in spec[kind]]
    return out


def _follow(node: Any, path: tuple[str, ...], where: str) -> list[tuple[str, Any]]:
    if not path:
        return [(where, node)] if isinstance(node, Mapping) else []
    head, rest = path[0], path[1:]
    if head == "*":
        return [x for i, item in enumerate(node or []) for x in _follow(item, rest, f"{where}[{i}]")]
    return _follow(node.get(head), rest, f"{where}.{head}") if isinstance(node, Mapping) else []


def pod_templates(obj: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod) for each pod the object would create, `where` being the template's path in the object
    ("" for a Pod); a kind that holds no pods gives []."""
    path = TEMPLATE_PATHS.get(str(obj.get("kind")))
    if path is None:
        return []
    return [(where.lstrip("."), {"metadata": dict(t.get("metadata") or {}), "spec": dict(t.get("spec") or {})})
            for where, t in _follow(obj, path, "")]


_POD_FIELDS = ("hostNetwork", "hostPID", "hostIPC", "hostUsers", "os")
_CONTAINER_FIELDS = ("securityContext",)
_ANNOTATION_PREFIXES = ("container.apparmor.security.beta.kubernetes.io/", "seccomp.security.alpha.kubernetes.io/",
                        "container.seccomp.security.alpha.kubernetes.io/")


def _container_skeleton(c: Mapping[str, Any], host_network: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": c.get("name"), **{k: c[k] for k in _CONTAINER_FIELDS if c.get(k)}}
    # On the host network every port is a host port (_defaulted); elsewhere only those that set one.
    ports = [{k: p[k] for k in ("name", "containerPort", "hostPort") if p.get(k) is not None}
             for p in c.get("ports") or [] if p.get("hostPort") or host_network]
    return {**out, "ports": ports} if ports else out


def skeleton(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The pod reduced to the fields the checks (and the team namespaces' admission policies' host checks)
    read: host namespaces, the pod's and every container's securityContext, host ports, each volume's
    source (a hostPath with its path and type), AppArmor and seccomp annotations. Evaluating the skeleton
    gives the same verdict as evaluating the pod."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    out_spec: dict[str, Any] = {k: spec[k] for k in _POD_FIELDS if spec.get(k) is not None}
    if spec.get("securityContext"):
        out_spec["securityContext"] = spec["securityContext"]
    for kind in CONTAINER_KINDS:
        if spec.get(kind):
            out_spec[kind] = [_container_skeleton(c, spec.get("hostNetwork") is True) for c in spec[kind]]
    if spec.get("volumes"):
        out_spec["volumes"] = [{"name": v.get("name"),
                                **{k: (val if k == "hostPath" else {}) for k, val in v.items() if k != "name"}}
                               for v in spec["volumes"]]
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(_ANNOTATION_PREFIXES)}
    return {"metadata": {"annotations": annotations} if annotations else {}, "spec": out_spec}
