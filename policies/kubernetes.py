"""Kubernetes rules: training pod security, digest-pinned images, resource requests, default-deny.

Usage: `from policies import kubernetes; list(kubernetes.container_requests(res, ctx))` yields one
detail string per problem; `namespace_default_deny` is a stack rule yielding `(resource, detail)`.

Training pods are the JobSet's pods and every typed workload in a team namespace
(`naming.team_namespace`, "team-<name>"). One documented exemption: Google's GPUDirect
receive-datapath sidecars (`GPUDIRECT_RXDM`, matched by container name AND image repository). Objects that Helm charts render are not visible to policies
(a Helm release is one resource); the charts' values set their own security contexts.

References: Pod security "restricted" profile
(https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted); default-deny
NetworkPolicy (https://kubernetes.io/docs/concepts/services-networking/network-policies/#default-policies).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from infra import naming
from policies.core import Context, Resource, dig, falsy, items, truthy

JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
NAMESPACE = "kubernetes:core/v1:Namespace"
NETWORK_POLICY = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
# type token -> path from the object to its pod spec(s); "*" fans out over a list.
POD_SPEC_PATHS: dict[str, tuple[str, ...]] = {
    "kubernetes:core/v1:Pod": ("spec",),
    "kubernetes:apps/v1:Deployment": ("spec", "template", "spec"),
    "kubernetes:apps/v1:StatefulSet": ("spec", "template", "spec"),
    "kubernetes:apps/v1:DaemonSet": ("spec", "template", "spec"),
    "kubernetes:apps/v1:ReplicaSet": ("spec", "template", "spec"),
    "kubernetes:batch/v1:Job": ("spec", "template", "spec"),
    "kubernetes:batch/v1:CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
    JOBSET: ("spec", "replicatedJobs", "*", "template", "spec", "template", "spec"),
}
TEAM_NAMESPACE_PREFIX = naming.team_namespace("")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
# The one exemption from training-pod-security and training-image-digest: Google's GPUDirect
# receive-datapath managers, the native sidecars a TCPX/TCPXO training pod needs next to the trainer
# (infra/gcp/fabric.py). They program flow steering on the GPU NICs, so Google's manifests run them
# privileged and as root, and Google publishes them by version tag only
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx,
# https://github.com/GoogleCloudPlatform/container-engine-accelerators/tree/master/gpudirect-tcpxo).
# Exempt only when BOTH the container name and the image repository match: any other privileged,
# root or tag-pinned container in a training pod still fails, and so does one of these names running
# any other image. Resource requests are still required of them.
GPUDIRECT_RXDM: dict[str, str] = {
    "tcpx-daemon": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/",
    "tcpxo-daemon": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/",
}
# What may follow the repository prefix: one image name, then a tag and/or a digest (no sub-paths).
_RXDM_IMAGE_REST = re.compile(r"[a-z0-9][a-z0-9._-]*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(@sha256:[0-9a-f]{64})?")


def pod_specs(res: Resource) -> list[tuple[str, Mapping[str, Any]]]:
    """(where, pod spec) for every pod template of a typed workload; [] for other types."""
    path = POD_SPEC_PATHS.get(res.type)
    if path is None:
        return []
    found: list[tuple[str, Any]] = [("", res.props)]
    for step in path:
        nxt = []
        for where, node in found:
            if step == "*":
                nxt += [(f"{where}[{i}]", el) for i, el in enumerate(items(node))]
            elif isinstance(node, Mapping) and node.get(step) is not None:
                nxt.append((f"{where}.{step}" if where else step, node[step]))
        found = nxt
    return [(w, s) for w, s in found if isinstance(s, Mapping)]


def containers(spec: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(kind[index] name, container) over containers and initContainers."""
    out = []
    for kind in ("initContainers", "containers"):
        for i, c in enumerate(items(spec.get(kind))):
            if isinstance(c, Mapping):
                out.append((f"{kind}[{i}] {c.get('name', '')!s}".rstrip(), c))
    return out


def is_training(res: Resource) -> bool:
    """JobSets, and typed workloads in a team namespace."""
    namespace = res.get("metadata", "namespace", default="")
    return res.type == JOBSET or (res.type in POD_SPEC_PATHS and str(namespace).startswith(TEAM_NAMESPACE_PREFIX))


def is_gpudirect_rxdm(container: Mapping[str, Any]) -> bool:
    """A GPUDirect receive-datapath manager: its name and Google's repository for it (GPUDIRECT_RXDM)."""
    repo = GPUDIRECT_RXDM.get(str(container.get("name", "")))
    image = container.get("image")
    return (repo is not None and isinstance(image, str) and image.startswith(repo)
            and _RXDM_IMAGE_REST.fullmatch(image[len(repo):]) is not None)


def training_pod_security(res: Resource, ctx: Context) -> Iterator[str]:
    """Training pods run as non-root without privilege escalation (GPUDirect managers exempt)."""
    if not is_training(res):
        return
    for where, spec in pod_specs(res):
        pod_non_root = truthy(dig(spec, "securityContext", "runAsNonRoot"))
        pod_root_uid = dig(spec, "securityContext", "runAsUser") == 0
        for name, c in containers(spec):
            if is_gpudirect_rxdm(c):
                continue
            sc = c.get("securityContext") or {}
            non_root = dig(sc, "runAsNonRoot")
            if falsy(non_root) or not (truthy(non_root) or pod_non_root):
                yield f"{where} {name}: runAsNonRoot is not true (pod or container securityContext)."
            if dig(sc, "runAsUser") == 0 or (pod_root_uid and dig(sc, "runAsUser") is None):
                yield f"{where} {name}: runAsUser is 0 (root)."
            if not falsy(dig(sc, "allowPrivilegeEscalation")):
                yield f"{where} {name}: securityContext.allowPrivilegeEscalation is not false."
            if truthy(dig(sc, "privileged")):
                yield f"{where} {name}: securityContext.privileged is true."


def _unpinned(res: Resource, exempt_rxdm: bool = False) -> Iterator[str]:
    for where, spec in pod_specs(res):
        for name, c in containers(spec):
            if exempt_rxdm and is_gpudirect_rxdm(c):
                continue
            image = c.get("image")
            if not isinstance(image, str) or not _DIGEST.search(image):
                yield f"{where} {name}: image {image!r} is not pinned by digest (@sha256:...)."


def training_image_digest(res: Resource, ctx: Context) -> Iterator[str]:
    """Training pods run images pinned by digest (GPUDirect managers exempt: Google tags them)."""
    if is_training(res):
        yield from _unpinned(res, exempt_rxdm=True)


def image_digest(res: Resource, ctx: Context) -> Iterator[str]:
    """Every other typed workload runs images pinned by digest (advisory)."""
    if not is_training(res):
        yield from _unpinned(res)


def container_requests(res: Resource, ctx: Context) -> Iterator[str]:
    """Every container of a typed workload requests CPU and memory."""
    for where, spec in pod_specs(res):
        for name, c in containers(spec):
            requests = dig(c, "resources", "requests") or {}
            missing = [r for r in ("cpu", "memory") if not dig(requests, r)]
            if missing:
                yield f"{where} {name}: resources.requests lacks {', '.join(missing)}."


def _is_default_deny(policy: Resource) -> bool:
    spec = policy.get("spec") or {}
    # podSelector {} selects every pod; an empty map may be dropped on the way into the plan.
    selector = dig(spec, "podSelector", default={})
    selects_all = not dig(selector, "matchLabels") and not dig(selector, "matchExpressions")
    types = set(items(dig(spec, "policyTypes")))
    return (selects_all and {"Ingress", "Egress"} <= types
            and not items(dig(spec, "ingress")) and not items(dig(spec, "egress")))


def namespace_default_deny(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Every namespace the stack creates has a default-deny NetworkPolicy for ingress and egress."""
    denied = {p.get("metadata", "namespace") for p in resources
              if p.type == NETWORK_POLICY and _is_default_deny(p)}
    for ns in resources:
        if ns.type != NAMESPACE:
            continue
        name = ns.get("metadata", "name")
        if not name:
            yield ns, "metadata.name is not set, so no NetworkPolicy can be tied to this namespace."
        elif name not in denied:
            yield ns, (f"namespace {name!r} has no NetworkPolicy with podSelector {{}}, policyTypes "
                       "[Ingress, Egress] and no rules.")
