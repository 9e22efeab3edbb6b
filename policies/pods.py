"""Pod security over one Kubernetes object: host isolation, non-root, the restricted profile for training.

Usage:
    from policies import pods
    pods.host_isolation_problems(obj)    # privileged, host namespaces, hostPath, hostPort, capabilities
    pods.non_root_problems(obj)          # root or privilege escalation (platform pods)
    pods.training_problems(obj)          # the Pod Security Standards `restricted` profile (training pods)
    pods.host_agent(obj)                 # the HostAgent exemption that matches, or None

Each function takes one Kubernetes object as a plain mapping (a plan resource's inputs, or what an
admission request carries) and returns one string per problem, so the CrossGuard pack, the offline
checker and an in-cluster admission policy can judge the same object the same way. Pod templates are
found in every kind that has one (Pod, PodTemplate, Deployment, StatefulSet, DaemonSet, ReplicaSet,
ReplicationController, Job, CronJob, JobSet, LeaderWorkerSet) and, for any other kind, wherever its
spec holds a mapping with a `containers` list; every container kind (init, regular, ephemeral) counts.

The checks follow the Kubernetes Pod Security Standards
(https://kubernetes.io/docs/concepts/security/pod-security-standards/) as implemented by
k8s.io/pod-security-admission: privileged containers, host namespaces, hostPath volumes and host ports
(baseline), capabilities beyond NET_BIND_SERVICE and the drop-ALL requirement, running as non-root,
no privilege escalation and a RuntimeDefault/Localhost seccomp profile (restricted). That library is
Go, run by the API server, and has no maintained Python counterpart, so the checks are written here
from its sources (check_capabilities_restricted.go, check_runAsNonRoot.go, ...); they must also judge
custom resources (JobSet) and allow the platform's exemptions, which admission cannot.

Host paths. Baseline forbids every hostPath; this platform needs three kinds, allowed for any pod:
- its own namespace's NVMe work directory, `<NVMe root>/gpu-train/<namespace>` (infra/k8s/nvme.py
  creates one per team, owned by the trainer's UID), never another namespace's nor the root;
- GKE's GPU driver and NCCL plugin directories (`NVIDIA_HOST_LIB`, `GIB_HOST_DIR`), read-only;
- TCPXO's `/dev/aperture_devices` (the GPU NICs' DMA apertures).
Everything else (`/`, `/sys`, `/proc/sys`, `/var/lib`, a node's NVMe root) needs an exemption.

Exemptions: only the platform's own host agents, each matched by object kind, namespace and name
(`HOST_AGENTS`) and, per container, by container name and image repository (any tag or digest of
that repository); and Google's GPUDirect receive-datapath sidecars (`RXDM_SIDECARS`) in training
pods, matched by container name and image repository. A grant lists exactly what the agent needs
(host namespaces, host paths, privileged, root, added capabilities); anything else in the same object
is checked as usual, and the same object under another name or namespace, or a granted container
running another image, gets no exemption. docs/policies.md explains each one.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infra import naming
from policies.core import Resource, dig, falsy, items, truthy

TEAM_NAMESPACE_PREFIX = naming.team_namespace("")

# kind -> paths from the object to its pod spec(s); "*" fans out over a list.
POD_SPEC_PATHS: dict[str, tuple[tuple[str, ...], ...]] = {
    "Pod": (("spec",),),
    "PodTemplate": (("template", "spec"),),
    "Deployment": (("spec", "template", "spec"),),
    "StatefulSet": (("spec", "template", "spec"),),
    "DaemonSet": (("spec", "template", "spec"),),
    "ReplicaSet": (("spec", "template", "spec"),),
    "ReplicationController": (("spec", "template", "spec"),),
    "Job": (("spec", "template", "spec"),),
    "CronJob": (("spec", "jobTemplate", "spec", "template", "spec"),),
    "JobSet": (("spec", "replicatedJobs", "*", "template", "spec", "template", "spec"),),
    "LeaderWorkerSet": (("spec", "leaderWorkerTemplate", "leaderTemplate", "spec"),
                        ("spec", "leaderWorkerTemplate", "workerTemplate", "spec")),
}
CONTAINER_KINDS = ("initContainers", "containers", "ephemeralContainers")
# Pod Security Standards, restricted: the one capability a container may add.
RESTRICTED_ADDABLE = frozenset({"NET_BIND_SERVICE"})
SECCOMP_OK = ("RuntimeDefault", "Localhost")

# Where the GPU nodes' NVMe array is mounted: infra/aws/gpu_nodes.py NVME_HOST_PATH (nodeadm's RAID0
# of the instance store) and infra/gcp/__init__.py NVME_HOST_PATH (the nvme-raid0 DaemonSet's mount).
NVME_ROOTS = ("/mnt/k8s-disks/0", "/mnt/stateful_partition/gpu-train/nvme-raid")
WORKDIR_ROOT = "gpu-train"  # infra/k8s/nvme.py WORKDIR_ROOT
# GKE's driver install (also where the TCPX/TCPXO installers put NCCL's plugin) and the RDMA gIB
# plugin directory (infra/gcp/fabric.py NVIDIA_HOST_LIB, GIB_HOST_DIR).
NVIDIA_HOST_LIB = "/home/kubernetes/bin/nvidia/lib64"
GIB_HOST_DIR = "/home/kubernetes/bin/gib"
READ_ONLY_HOST_PATHS = frozenset({NVIDIA_HOST_LIB, GIB_HOST_DIR})
DEVICE_HOST_PATHS = frozenset({"/dev/aperture_devices"})

UBUNTU = "docker.io/library/ubuntu"
GOOGLE_GPUDIRECT = "us-docker.pkg.dev/gce-ai-infra"


@dataclass(frozen=True, kw_only=True)
class ContainerGrant:
    """What one exempt container may do beyond the usual checks."""

    image: str  # image repository (normalised: registry/path, no tag or digest)
    privileged: bool = False  # privileged; implies running as root with escalation and every capability
    root: bool = False  # may run as UID 0 (not privileged)
    capabilities: frozenset[str] = frozenset()  # may add these capabilities
    host_paths: frozenset[str] = frozenset()  # host paths it may mount (writable, or besides the usual list)


@dataclass(frozen=True, kw_only=True)
class HostAgent:
    """One of the platform's own host agents: an object matched by kind, namespace and name."""

    kind: str
    namespace: str
    name: str
    why: str  # why it needs the host (one sentence, repeated in docs/policies.md)
    host_network: bool = False
    host_pid: bool = False
    host_paths: frozenset[str] = frozenset()  # hostPath volumes the pod may declare
    containers: Mapping[str, ContainerGrant]  # container name -> grant


# The GPU pre-flight check of infra/k8s/health.py (PREFLIGHT_NAME, DCGM_IMAGE, GKE_NVIDIA_DIR), in the GPU
# agents' namespace.
PREFLIGHT_DCGM = "nvcr.io/nvidia/cloud-native/dcgm"
GKE_NVIDIA_DIR = "/home/kubernetes/bin/nvidia"
_NCCL_INSTALLER_WHY = ("Google's NCCL fabric plugin installer copies the plugin onto the host and configures the "
                       "GPU NICs in the host network namespace, from the host's mount namespace (nsenter).")
HOST_AGENTS: tuple[HostAgent, ...] = (
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nvme-raid0", host_pid=True,
              why="Builds a RAID0 array over GKE's raw local NVMe SSDs and mounts it on the host (mdadm, mkfs, "
                  "mount through nsenter into the host's namespaces), then creates each team's work directory.",
              host_paths=frozenset({"/mnt/stateful_partition/gpu-train/nvme-raid"}),
              containers={"raid0": ContainerGrant(image=UBUNTU, privileged=True),
                          "workdirs": ContainerGrant(image=UBUNTU, root=True,
                                                     capabilities=frozenset({"CHOWN", "FOWNER"}))}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nvme-workdirs",
              why="Creates each team's work directory on the node's NVMe array (mounted by nodeadm) and hands it "
                  "to the trainer's UID, which needs root with CAP_CHOWN and CAP_FOWNER only.",
              host_paths=frozenset({"/mnt/k8s-disks/0"}),
              containers={"workdirs": ContainerGrant(image=UBUNTU, root=True,
                                                     capabilities=frozenset({"CHOWN", "FOWNER"}))}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="gpu-preflight",
              why="Checks a new GPU node before it takes work (GPU count, ECC state, DCGM diagnostics, fabric "
                  "devices): it drives every GPU without holding them through the device plugin, so it is "
                  "privileged, and on GKE it runs the driver's tools from the host, read-only.",
              host_paths=frozenset({GKE_NVIDIA_DIR}),
              containers={"check": ContainerGrant(image=PREFLIGHT_DCGM, privileged=True,
                                                  host_paths=frozenset({GKE_NVIDIA_DIR}))}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nccl-tcpx-installer", host_network=True,
              host_pid=True, why=_NCCL_INSTALLER_WHY, host_paths=frozenset({"/var/lib"}),
              containers={
                  "install": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-tcpx/nccl-plugin-gpudirecttcpx-dev",
                                            privileged=True),
                  "host-mount": ContainerGrant(image=UBUNTU, privileged=True)}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nccl-tcpxo-installer", host_network=True,
              host_pid=True, why=_NCCL_INSTALLER_WHY, host_paths=frozenset({"/var/lib", "/home/kubernetes/bin"}),
              containers={
                  "install": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-tcpxo/nccl-plugin-gpudirecttcpx-dev",
                                            privileged=True)}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nccl-rdma-installer", host_network=True,
              host_pid=True, why=_NCCL_INSTALLER_WHY, host_paths=frozenset({NVIDIA_HOST_LIB, GIB_HOST_DIR}),
              containers={
                  "install": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-gib/nccl-plugin-gib",
                                            privileged=True)}),
)

# Google's GPUDirect receive-datapath managers, the native sidecars a TCPX/TCPXO training pod runs next
# to the trainer (infra/gcp/fabric.py): they program flow steering on the GPU NICs and tune the host's
# network sysctls through /sys and /proc/sys, so Google's manifests run them privileged and as root
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx,
# https://github.com/GoogleCloudPlatform/container-engine-accelerators/tree/master/gpudirect-tcpxo).
_RXDM_PATHS = frozenset({"/sys", "/proc/sys", NVIDIA_HOST_LIB})
RXDM_SIDECARS: dict[str, ContainerGrant] = {
    "tcpx-daemon": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-tcpx/tcpgpudmarxd-dev", privileged=True,
                                  host_paths=_RXDM_PATHS),
    "tcpxo-daemon": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-tcpxo/tcpgpudmarxd-dev", privileged=True,
                                   host_paths=_RXDM_PATHS),
}

_REGISTRY = re.compile(r"^([a-z0-9-]+\.[a-z0-9.-]+|localhost)(:[0-9]+)?$")


# --------------------------------------------------------------------------------------------
# Objects, pod templates, containers
# --------------------------------------------------------------------------------------------


def k8s_object(res: Resource) -> Mapping[str, Any] | None:
    """The Kubernetes object a typed Pulumi resource describes (kind/apiVersion from the type token
    when the props lack them); None for other resources and for Helm releases."""
    if not res.type.startswith("kubernetes:") or res.type.startswith(("kubernetes:helm.sh", "pulumi:")):
        return None
    props = res.props
    if props.get("kind"):
        return props
    _, module, kind = res.type.split(":", 2)
    api = module[len("core/"):] if module.startswith("core/") else module
    return {**props, "apiVersion": api, "kind": kind}


def namespace(obj: Mapping[str, Any]) -> str:
    return str(dig(obj, "metadata", "namespace", default=""))


def name(obj: Mapping[str, Any]) -> str:
    return str(dig(obj, "metadata", "name", default=""))


def _follow(obj: Any, path: tuple[str, ...]) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = [("", obj)]
    for step in path:
        nxt = []
        for where, node in found:
            if step == "*":
                nxt += [(f"{where}[{i}]", el) for i, el in enumerate(items(node))]
            elif isinstance(node, Mapping) and node.get(step) is not None:
                nxt.append((f"{where}.{step}" if where else step, node[step]))
        found = nxt
    return found


def _looks_like_pod_spec(node: Any) -> bool:
    return isinstance(node, Mapping) and any(
        isinstance(c, Mapping) and "image" in c for c in items(node.get("containers")))


def _search(node: Any, where: str, depth: int) -> list[tuple[str, Mapping[str, Any]]]:
    if depth > 8:
        return []
    if _looks_like_pod_spec(node):
        return [(where, node)]
    found = []
    if isinstance(node, Mapping):
        for key, value in node.items():
            found += _search(value, f"{where}.{key}", depth + 1)
    else:
        for i, value in enumerate(items(node)):
            found += _search(value, f"{where}[{i}]", depth + 1)
    return found


def pod_specs(obj: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(where, pod spec) for every pod template in one Kubernetes object."""
    paths = POD_SPEC_PATHS.get(str(obj.get("kind", "")))
    if paths is None:
        return _search(obj.get("spec"), "spec", 0)
    return [(w, s) for path in paths for w, s in _follow(obj, path) if isinstance(s, Mapping)]


def containers(spec: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(kind[index] name, container) over init, regular and ephemeral containers."""
    out = []
    for kind in CONTAINER_KINDS:
        for i, c in enumerate(items(spec.get(kind))):
            if isinstance(c, Mapping):
                out.append((f"{kind}[{i}] {c.get('name', '')!s}".rstrip(), c))
    return out


def is_training(obj: Mapping[str, Any]) -> bool:
    """Training pods: every JobSet, and any workload in a team namespace."""
    return obj.get("kind") == "JobSet" or (bool(pod_specs(obj)) and namespace(obj).startswith(TEAM_NAMESPACE_PREFIX))


def image_repository(image: Any) -> str:
    """`ubuntu:24.04` -> `docker.io/library/ubuntu`; `reg.io/a/b:t@sha256:..` -> `reg.io/a/b`."""
    ref = str(image or "").split("@", 1)[0]
    head, _, last = ref.rpartition("/")
    if ":" in last:
        last = last.split(":", 1)[0]
    parts = [p for p in (head.split("/") if head else []) + [last] if p]
    if not parts:
        return ""
    if len(parts) == 1 or not _REGISTRY.match(parts[0]):
        parts = ["docker.io", *(["library"] if len(parts) == 1 else []), *parts]
    return "/".join(parts)


def host_agent(obj: Mapping[str, Any]) -> HostAgent | None:
    """The host-agent exemption for this object (kind, namespace and name all match), or None."""
    return next((a for a in HOST_AGENTS if a.kind == obj.get("kind") and a.namespace == namespace(obj)
                 and a.name == name(obj)), None)


def grant(obj: Mapping[str, Any], container: Mapping[str, Any]) -> ContainerGrant | None:
    """The exemption a container of this object holds: its name and image repository must both match."""
    agent = host_agent(obj)
    cname = str(container.get("name", ""))
    candidate = agent.containers.get(cname) if agent else None
    if candidate is None and is_training(obj):
        candidate = RXDM_SIDECARS.get(cname)
    if candidate is not None and image_repository(container.get("image")) == candidate.image:
        return candidate
    return None


def _caps(container: Mapping[str, Any], key: str) -> set[str]:
    values = dig(container, "securityContext", "capabilities", key)
    return {str(c).upper().removeprefix("CAP_") for c in items(values)}


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _host_path_problems(obj: Mapping[str, Any], where: str, spec: Mapping[str, Any],
                        nvme_roots: Sequence[str] = NVME_ROOTS) -> list[str]:
    agent = host_agent(obj)
    ns = namespace(obj)
    workdirs = {f"{root}/{WORKDIR_ROOT}/{ns}" for root in nvme_roots} if ns else set()
    pod_grants = [grant(obj, c) for _, c in containers(spec)]
    problems = []
    for vol in items(spec.get("volumes")):
        raw = dig(vol, "hostPath", "path")
        if raw is None:
            continue
        path = posixpath.normpath(str(raw)) if str(raw) else ""
        vname = str(dig(vol, "name", default=""))
        mounters = [(label, c, m) for label, c in containers(spec) for m in items(c.get("volumeMounts"))
                    if dig(m, "name") == vname]
        if agent and path in agent.host_paths:
            continue
        if path in workdirs or path in DEVICE_HOST_PATHS:
            continue
        if path in READ_ONLY_HOST_PATHS:
            for label, c, m in mounters:
                g = grant(obj, c)
                if not truthy(dig(m, "readOnly")) and not (g and path in g.host_paths):
                    problems.append(f"{where} {label}: mounts host path {path} (volume {vname!r}) writable; "
                                    "it must be readOnly.")
            continue
        granted = [grant(obj, c) for _, c, _ in mounters]
        if mounters and all(g and path in g.host_paths for g in granted):
            continue
        if not mounters and any(g and path in g.host_paths for g in pod_grants):
            continue
        who = ", ".join(label for label, _, _ in mounters) or "no container yet"
        problems.append(f"{where} volume {vname!r}: hostPath {raw!r} is not an allowed host path "
                        f"(mounted by {who}); pods may mount only their namespace's NVMe work directory and "
                        "the GPU driver/plugin directories read-only.")
    return problems


def host_isolation_problems(obj: Mapping[str, Any], nvme_roots: Sequence[str] = NVME_ROOTS) -> list[str]:
    """Privileged containers, host namespaces, host paths, host ports and added capabilities.

    `nvme_roots`: where the NVMe work directories may be (both clouds' roots by default, so the pack judges
    any plan; one cluster's admission policy knows its own root)."""
    agent = host_agent(obj)
    problems = []
    for where, spec in pod_specs(obj):
        for field, allowed in (("hostNetwork", agent and agent.host_network), ("hostPID", agent and agent.host_pid),
                               ("hostIPC", False)):
            if truthy(spec.get(field)) and not allowed:
                problems.append(f"{where}: {field} is true, so the pod shares the node's "
                                f"{field[4:].lower() if field != 'hostPID' else 'process'} namespace.")
        problems += _host_path_problems(obj, where, spec, nvme_roots)
        for label, c in containers(spec):
            g = grant(obj, c)
            if truthy(dig(c, "securityContext", "privileged")) and not (g and g.privileged):
                problems.append(f"{where} {label}: securityContext.privileged is true.")
            extra = _caps(c, "add") - RESTRICTED_ADDABLE - (g.capabilities if g else frozenset())
            if extra and not (g and g.privileged):
                problems.append(f"{where} {label}: adds capabilities {', '.join(sorted(extra))} (the restricted "
                                "profile allows only NET_BIND_SERVICE).")
            ports = [dig(p, "hostPort") for p in items(c.get("ports"))]
            if any(p not in (None, 0) for p in ports):
                problems.append(f"{where} {label}: binds a hostPort, exposing the container on the node's address.")
    return problems


def _root_and_escalation(where: str, spec: Mapping[str, Any], label: str, c: Mapping[str, Any]) -> list[str]:
    sc = c.get("securityContext") or {}
    pod_non_root = truthy(dig(spec, "securityContext", "runAsNonRoot"))
    pod_root_uid = dig(spec, "securityContext", "runAsUser") == 0
    problems = []
    non_root = dig(sc, "runAsNonRoot")
    if falsy(non_root) or not (truthy(non_root) or pod_non_root):
        problems.append(f"{where} {label}: runAsNonRoot is not true (pod or container securityContext).")
    if dig(sc, "runAsUser") == 0 or (pod_root_uid and dig(sc, "runAsUser") is None):
        problems.append(f"{where} {label}: runAsUser is 0 (root).")
    if not falsy(dig(sc, "allowPrivilegeEscalation")):
        problems.append(f"{where} {label}: securityContext.allowPrivilegeEscalation is not false.")
    return problems


def non_root_problems(obj: Mapping[str, Any]) -> list[str]:
    """Containers run as non-root without privilege escalation (host-agent grants excepted)."""
    problems = []
    for where, spec in pod_specs(obj):
        for label, c in containers(spec):
            g = grant(obj, c)
            if g and g.privileged:
                continue
            found = _root_and_escalation(where, spec, label, c)
            if g and g.root:
                found = [p for p in found if "runAsNonRoot" not in p and "runAsUser" not in p]
            problems += found
    return problems


def training_problems(obj: Mapping[str, Any]) -> list[str]:
    """The restricted profile's user and process controls for a training pod (GPUDirect sidecars excepted):
    non-root, no escalation, every capability dropped, RuntimeDefault or Localhost seccomp."""
    problems = []
    for where, spec in pod_specs(obj):
        pod_seccomp = dig(spec, "securityContext", "seccompProfile", "type")
        for label, c in containers(spec):
            g = grant(obj, c)
            if g and g.privileged:
                continue
            problems += _root_and_escalation(where, spec, label, c)
            if "ALL" not in _caps(c, "drop"):
                problems.append(f"{where} {label}: securityContext.capabilities.drop does not include ALL.")
            seccomp = dig(c, "securityContext", "seccompProfile", "type", default=pod_seccomp)
            if seccomp not in SECCOMP_OK:
                problems.append(f"{where} {label}: seccompProfile.type is {seccomp!r}; it must be RuntimeDefault "
                                "or Localhost (pod or container securityContext).")
    return problems
