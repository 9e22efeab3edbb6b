"""Kubernetes rules: pod security, digest-pinned images, requests, network policies, load balancers.

Usage: `from policies import kubernetes; list(kubernetes.container_requests(res, ctx))` yields one
detail string per problem; `namespace_default_deny` and `no_public_load_balancer` are stack rules
yielding `(resource, detail)`.

Every rule here judges one Kubernetes object at a time through a plain function of that object
(`policies.pods`, `policies.rbac`, `allow_all_problems`, `load_balancer_problems`), so an admission
policy in the cluster can apply the same function to the same object. Objects that Helm charts
render are not visible to policies (a Helm release is one resource); the charts' values set their
own security contexts.

Training pods are the JobSet's pods and every workload in a team namespace
(`naming.team_namespace`, "team-<name>"); they are held to the restricted profile
(`training_pod_security`), other pods to non-root without escalation (`pod_non_root`), and all pods
to host isolation (`pod_host_isolation`). Exemptions are listed in `policies.pods`.

References: Pod Security Standards
(https://kubernetes.io/docs/concepts/security/pod-security-standards/); default-deny and allow-all
NetworkPolicies (https://kubernetes.io/docs/concepts/services-networking/network-policies/#default-policies);
internal load balancers on EKS
(https://kubernetes-sigs.github.io/aws-load-balancer-controller/latest/guide/service/annotations/#lb-scheme)
and GKE (https://cloud.google.com/kubernetes-engine/docs/concepts/service-load-balancer-parameters);
Ingress defaults (https://kubernetes-sigs.github.io/aws-load-balancer-controller/latest/guide/ingress/annotations/#scheme,
https://cloud.google.com/kubernetes-engine/docs/concepts/ingress#ingress_class).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gpu_train.spec.pod_rules import serving_image
from policies import pods
from policies.cidrs import blocks_coverage
from policies.core import Context, Resource, dig, items
from policies.pods import containers, is_training, k8s_object, pod_specs

NAMESPACE = "kubernetes:core/v1:Namespace"
NETWORK_POLICY = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")

# Annotations that make a Service's load balancer internal, per cloud (values compared lowercased).
INTERNAL_LB_ANNOTATIONS: dict[str, dict[str, str]] = {
    # AWS Load Balancer Controller, then the in-tree cloud provider.
    "aws": {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal",
            "service.beta.kubernetes.io/aws-load-balancer-internal": "true"},
    # GKE, current then legacy annotation.
    "gcp": {"networking.gke.io/load-balancer-type": "internal",
            "cloud.google.com/load-balancer-type": "internal"},
}
INGRESS_CLASS_ANNOTATION = "kubernetes.io/ingress.class"
ALB_SCHEME_ANNOTATION = "alb.ingress.kubernetes.io/scheme"


# --------------------------------------------------------------------------------------------
# Pod security
# --------------------------------------------------------------------------------------------


def pod_host_isolation(res: Resource, ctx: Context) -> Iterator[str]:
    """No pod is privileged, shares host namespaces, mounts other host paths, binds host ports or adds capabilities."""
    obj = k8s_object(res)
    if obj is not None:
        yield from pods.host_isolation_problems(obj)


def pod_non_root(res: Resource, ctx: Context) -> Iterator[str]:
    """Pods other than training pods run as non-root without privilege escalation."""
    obj = k8s_object(res)
    if obj is not None and not is_training(obj):
        yield from pods.non_root_problems(obj)


def training_pod_security(res: Resource, ctx: Context) -> Iterator[str]:
    """Training pods meet the restricted profile's user and process controls (GPUDirect sidecars exempt)."""
    obj = k8s_object(res)
    if obj is not None and is_training(obj):
        yield from pods.training_problems(obj)


def _unpinned(obj: Mapping[str, Any], exempt_sidecars: bool = False) -> Iterator[str]:
    for where, spec in pod_specs(obj):
        for name, c in containers(spec):
            if exempt_sidecars and (pods.grant(obj, c) is not None or serving_image(c)):
                continue
            image = c.get("image")
            if not isinstance(image, str) or not _DIGEST.search(image):
                yield f"{where} {name}: image {image!r} is not pinned by digest (@sha256:...)."


def training_image_digest(res: Resource, ctx: Context) -> Iterator[str]:
    """Training pods run images pinned by digest (GPUDirect sidecars and KServe's pinned serving images exempt:
    Google and KServe tag them)."""
    obj = k8s_object(res)
    if obj is not None and is_training(obj):
        yield from _unpinned(obj, exempt_sidecars=True)


def image_digest(res: Resource, ctx: Context) -> Iterator[str]:
    """Every other typed workload runs images pinned by digest (advisory)."""
    obj = k8s_object(res)
    if obj is not None and not is_training(obj):
        yield from _unpinned(obj)


def container_requests(res: Resource, ctx: Context) -> Iterator[str]:
    """Every container of a typed workload requests CPU and memory."""
    obj = k8s_object(res)
    for where, spec in pod_specs(obj) if obj is not None else []:
        for name, c in containers(spec):
            if c in items(spec.get("ephemeralContainers")):
                continue  # ephemeral containers take no resources
            requests = dig(c, "resources", "requests") or {}
            missing = [r for r in ("cpu", "memory") if not dig(requests, r)]
            if missing:
                yield f"{where} {name}: resources.requests lacks {', '.join(missing)}."


# --------------------------------------------------------------------------------------------
# Network policies
# --------------------------------------------------------------------------------------------


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


def _selects_everything(selector: Any) -> bool:
    return isinstance(selector, Mapping) and not dig(selector, "matchLabels") and not dig(selector, "matchExpressions")


def _peers_reach(peers: list) -> str | None:
    """What a rule's peer list admits when that is everyone: None when the peers restrict it."""
    if not peers:
        return "every source and destination (no peers listed)"
    coverage = blocks_coverage((dig(p, "ipBlock", "cidr"), items(dig(p, "ipBlock", "except")))
                               for p in peers if dig(p, "ipBlock"))
    if coverage:
        return f"{coverage} (ipBlock)"
    for p in peers:
        if (isinstance(p, Mapping) and "namespaceSelector" in p and _selects_everything(p.get("namespaceSelector"))
                and _selects_everything(p.get("podSelector", {}))):
            return "every pod in every namespace"
    return None


def allow_all_problems(obj: Mapping[str, Any]) -> list[str]:
    """Rules of one NetworkPolicy that undo a default-deny: ingress from anyone, or egress to anyone on any port."""
    if obj.get("kind") != "NetworkPolicy":
        return []
    spec = obj.get("spec") or {}
    problems = []
    for i, rule in enumerate(items(spec.get("ingress"))):
        reach = _peers_reach(items(dig(rule, "from")))
        if reach:
            ports = "every port" if not items(dig(rule, "ports")) else "the listed ports"
            problems.append(f"spec.ingress[{i}] admits {reach} on {ports}, which undoes the namespace's default deny.")
    for i, rule in enumerate(items(spec.get("egress"))):
        reach = _peers_reach(items(dig(rule, "to")))
        if reach and not items(dig(rule, "ports")):
            problems.append(f"spec.egress[{i}] allows traffic to {reach} on every port, which undoes the "
                            "namespace's default deny.")
    return problems


def network_policy_no_allow_all(res: Resource, ctx: Context) -> Iterator[str]:
    """No NetworkPolicy admits everyone, or lets pods reach everyone on every port."""
    obj = k8s_object(res)
    if obj is not None:
        yield from allow_all_problems(obj)


# --------------------------------------------------------------------------------------------
# Load balancers
# --------------------------------------------------------------------------------------------


def _annotations(obj: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v).strip().lower() for k, v in (dig(obj, "metadata", "annotations") or {}).items()}


def load_balancer_problems(obj: Mapping[str, Any], cloud: str | None) -> list[str]:
    """Whether a Service or Ingress gets an internet-facing load balancer on `cloud` ("aws" | "gcp" |
    None when unknown, which accepts either cloud's internal annotation)."""
    notes = _annotations(obj)
    kind = obj.get("kind")
    if kind == "Service" and dig(obj, "spec", "type") == "LoadBalancer":
        clouds = [cloud] if cloud in INTERNAL_LB_ANNOTATIONS else list(INTERNAL_LB_ANNOTATIONS)
        wanted = {k: v for c in clouds for k, v in INTERNAL_LB_ANNOTATIONS[c].items()}
        if not any(notes.get(k) == v for k, v in wanted.items()):
            names = " or ".join(f"{k}: {v!r}" for k, v in wanted.items())
            return [f"spec.type is LoadBalancer without {names}, so the load balancer is internet-facing."]
    elif kind == "Ingress":
        ingress_class = str(dig(obj, "spec", "ingressClassName") or notes.get(INGRESS_CLASS_ANNOTATION) or "")
        if ingress_class == "alb" and notes.get(ALB_SCHEME_ANNOTATION) == "internet-facing":
            return [f"{ALB_SCHEME_ANNOTATION} is internet-facing."]
        if cloud == "gcp" and ingress_class in ("", "gce"):
            return [f"the Ingress class is {ingress_class or 'unset'}, which GKE serves from an external load "
                    "balancer; use gce-internal."]
    return []


def cloud_of(resources: Sequence[Resource]) -> str | None:
    """aws or gcp when the stack's resources belong to exactly one of them."""
    clouds = {c for c in ("aws", "gcp") if any(r.type.startswith(f"{c}:") for r in resources)}
    return clouds.pop() if len(clouds) == 1 else None


def no_public_load_balancer(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Services and Ingresses get internal load balancers only."""
    cloud = cloud_of(resources)
    for res in resources:
        obj = k8s_object(res)
        if obj is not None:
            for problem in load_balancer_problems(obj, cloud):
                yield res, problem
