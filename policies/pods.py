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

Image exemptions: KServe's model server and storage initializer in serving pods, by container name and exact
pinned image (`SERVING_IMAGES`: KServe tags its images and publishes no digests), are exempt from the digest and
registry rules only.

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
from collections.abc import Mapping, Sequence
from typing import Any

from gpu_train.spec.pod_rules import (
    CONTAINER_KINDS,
    DEVICE_HOST_PATHS,
    HOST_AGENTS,
    NVME_ROOTS,
    POD_SPEC_PATHS,
    READ_ONLY_HOST_PATHS,
    RESTRICTED_ADDABLE,
    RXDM_SIDECARS,
    SECCOMP_OK,
    TEAM_NAMESPACE_PREFIX,
    WORKDIR_ROOT,
    ContainerGrant,
    HostAgent,
    image_allowed,
    image_repository,
    serving_image,
)
from policies.core import Resource, dig, falsy, items, truthy

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


def registry_problems(obj: Mapping[str, Any], registries: Sequence[str], repositories: Sequence[str] = ()) -> list[str]:
    """The team namespaces' image-registry rule (infra/k8s/pod_admission.py) over one object: every container not
    covered by a GPUDirect sidecar grant, and not one of KServe's at its pinned image, runs an image from the platform
    registry."""
    problems = []
    for where, spec in pod_specs(obj):
        for label, c in containers(spec):
            if serving_image(c):
                continue
            if grant(obj, c) is None and not image_allowed(c.get("image"), registries, repositories):
                problems.append(f"{where} {label}: image {c.get('image')!r} is not from the platform registry "
                                f"({', '.join([*registries, *repositories])}).")
    return problems
