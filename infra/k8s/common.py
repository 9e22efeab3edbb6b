"""Small pure helpers shared by the Kubernetes layer: scheduling on GPU/system nodes, container
security and resources, namespaces, and the NetworkPolicy building blocks.

Usage: `from infra.k8s import common`; everything here returns plain dicts (Kubernetes field names)
so tests call it without Pulumi mocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from gpu_train.spec import naming
from infra.platform import ClusterPlatform, EgressTarget, GpuPool

# Namespaces this layer creates besides the team namespaces.
GPU_NAMESPACE = "gpu-system"
KUEUE_NAMESPACE = "kueue-system"
JOBSET_NAMESPACE = "jobset-system"
# Label JobSet puts on every pod of a JobSet (https://jobset.sigs.k8s.io/docs/concepts/).
JOBSET_NAME_LABEL = naming.JOBSET_NAME_LABEL
# Namespace label the API server sets on every namespace (Kubernetes >= 1.22).
NS_NAME_LABEL = "kubernetes.io/metadata.name"
CHECKOV_SKIPS = Path(__file__).resolve().parent / "checkov-skips.yaml"


def checkov_skips(path: Path = CHECKOV_SKIPS) -> dict[str, dict[str, str]]:
    """The documented checkov skips: object name -> {check id: reason}; every entry needs a reason."""
    doc = yaml.safe_load(path.read_text()) or {}
    for obj, checks in doc.items():
        if not isinstance(checks, dict) or not checks:
            raise ValueError(f"{path}: {obj!r} must map check ids to reasons")
        for check, reason in checks.items():
            if not str(check).startswith("CKV_K8S_") or not isinstance(reason, str) or len(reason) < 20:
                raise ValueError(f"{path}: {obj}.{check} needs a CKV_K8S_ id and a reason (got {reason!r})")
    return doc


def checkov_skip_annotations(name: str, path: Path = CHECKOV_SKIPS) -> dict[str, str]:
    """Annotations (checkov.io/skipN: CHECK=reason) carrying an object's documented skips."""
    checks = checkov_skips(path).get(name, {})
    return {f"checkov.io/skip{i}": f"{check}={reason}" for i, (check, reason) in enumerate(sorted(checks.items()), 1)}


def k8s_opts(platform: ClusterPlatform, parent: pulumi.Resource, depends_on: Sequence[pulumi.Resource] = ()
             ) -> pulumi.ResourceOptions:
    """Options for a Kubernetes child: the cluster's provider, its component parent, ordering."""
    return pulumi.ResourceOptions(provider=platform.provider, parent=parent, depends_on=list(depends_on))


def resources(cpu: str, memory: str, cpu_limit: str | None = None, memory_limit: str | None = None
              ) -> dict[str, dict[str, str]]:
    """Requests and limits for one container (memory limit defaults to the request: no overcommit)."""
    return {
        "requests": {"cpu": cpu, "memory": memory},
        "limits": {"cpu": cpu_limit or cpu, "memory": memory_limit or memory},
    }


def gpu_tolerations(pools: Iterable[GpuPool]) -> list[dict[str, str]]:
    """The GPU taint toleration plus every pool's own tolerations, without duplicates."""
    out: list[dict[str, str]] = []
    gpu = {"key": naming.GPU_TAINT["key"], "operator": "Exists", "effect": naming.GPU_TAINT["effect"]}
    for tol in [gpu, *(dict(t) for p in pools for t in p.tolerations)]:
        if tol not in out:
            out.append(tol)
    return out


def fabric_pools(pools: Iterable[GpuPool], fabric: str) -> list[GpuPool]:
    """The pools whose nodes are on the named fabric (their nodes carry gpu-train.io/fabric=<fabric>)."""
    return [pool for pool in pools if pool.fabric.kind in (fabric,)]


def pool_affinity(pools: Iterable[GpuPool], extra: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Required node affinity: any node of the given pools (by the pool label), plus extra terms."""
    names = sorted({p.name for p in pools})
    expressions = [{"key": naming.POOL_LABEL, "operator": "In", "values": names}, *map(dict, extra)]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": expressions}]}}}


def restricted_container_security() -> dict[str, Any]:
    """Container securityContext that meets the `restricted` Pod Security Standard."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "runAsGroup": 65532,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def namespace(name: str, platform: ClusterPlatform, parent: pulumi.Resource, *,
              labels: Mapping[str, str] | None = None, enforce: str = "baseline",
              depends_on: Sequence[pulumi.Resource] = ()) -> k8s.core.v1.Namespace:
    """A namespace with Pod Security admission labels (enforce the given level, warn at restricted)."""
    all_labels = {
        "app.kubernetes.io/managed-by": "pulumi",
        "pod-security.kubernetes.io/enforce": enforce,
        "pod-security.kubernetes.io/warn": "restricted",
        "pod-security.kubernetes.io/audit": "restricted",
        **(labels or {}),
    }
    return k8s.core.v1.Namespace(
        f"ns-{name}", metadata={"name": name, "labels": all_labels},
        opts=k8s_opts(platform, parent, depends_on))


def helm_release(resource_name: str, release: str, chart: str, version: str, repo: str | None, namespace: str,
                 opts: pulumi.ResourceOptions, **kwargs: Any) -> k8s.helm.v3.Release:
    """The Helm release `release` of `chart` at `version` from the repository `repo` (None: an OCI chart, whose
    registry is part of `chart`) in `namespace`; kwargs are the Release's other arguments (values, skip_await)."""
    repository = {"repository_opts": k8s.helm.v3.RepositoryOptsArgs(repo=repo)} if repo else {}
    return k8s.helm.v3.Release(resource_name, name=release, chart=chart, version=version, namespace=namespace,
                               **repository, **kwargs, opts=opts)


# ------------------------------------------------------------------------------------------
# NetworkPolicy specs. Each function returns (name, spec) for one policy in one namespace.
# ------------------------------------------------------------------------------------------

Policy = tuple[str, dict[str, Any]]


def default_deny() -> Policy:
    """Deny all ingress and egress for every pod of the namespace; other policies add holes."""
    return "default-deny-all", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}


def allow_dns() -> Policy:
    """Egress to the cluster DNS (kube-dns in kube-system; GKE and EKS both label it k8s-app=kube-dns)."""
    return "allow-dns", {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [{
            "to": [{"namespaceSelector": {"matchLabels": {NS_NAME_LABEL: "kube-system"}},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        }],
    }


def cidr_peers(cidrs: Iterable[str]) -> list[dict[str, Any]]:
    """NetworkPolicy peers for address ranges."""
    return [{"ipBlock": {"cidr": c}} for c in cidrs]


def allow_api_server(cidrs: Sequence[str]) -> Policy:
    """Egress to the Kubernetes API server (controllers, operators, feature discovery)."""
    if not cidrs:
        raise ValueError("platform.api_server_cidrs is empty: the API-server egress policy needs its addresses")
    return "allow-api-server", {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [{"to": cidr_peers(cidrs),
                    "ports": [{"protocol": "TCP", "port": 443}, {"protocol": "TCP", "port": 6443}]}],
    }


def allow_webhooks_from_api_server(cidrs: Sequence[str], ports: Sequence[int]) -> Policy:
    """Ingress from the control plane to admission/conversion webhooks served in the namespace."""
    return "allow-webhooks-from-api-server", {
        "podSelector": {},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": cidr_peers(cidrs),
                     "ports": [{"protocol": "TCP", "port": p} for p in ports]}],
    }


def allow_object_store(cidrs: Sequence[str], identity_egress: Sequence[EgressTarget]) -> Policy:
    """Egress to the object store over HTTPS, and to the endpoints that hand out workload-identity
    credentials (platform.workload_identity_egress: the EKS Pod Identity agent, the GKE metadata server)."""
    if not cidrs:
        raise ValueError("platform.object_store_cidrs is empty: the object-store egress policy needs its ranges")
    if not identity_egress:
        raise ValueError("platform.workload_identity_egress is empty: pods could not obtain cloud credentials")
    identity = [{"to": [{"ipBlock": {"cidr": t.cidr}}], "ports": [{"protocol": t.protocol, "port": t.port}]}
                for t in identity_egress]
    return "allow-object-store", {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [{"to": cidr_peers(cidrs), "ports": [{"protocol": "TCP", "port": 443}]}, *identity],
    }


def allow_same_namespace() -> Policy:
    """All traffic between the namespace's own pods (controllers talking to their peers)."""
    return "allow-same-namespace", {
        "podSelector": {},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [{"podSelector": {}}]}],
        "egress": [{"to": [{"podSelector": {}}]}],
    }


def allow_metrics_scrape(ports: Sequence[int], pod_selector: Mapping[str, Any] | None = None,
                         end_port: int | None = None) -> Policy:
    """Ingress from Prometheus in the monitoring namespace to the metrics ports."""
    if end_port is not None:
        port_list = [{"protocol": "TCP", "port": ports[0], "endPort": end_port}]
    else:
        port_list = [{"protocol": "TCP", "port": p} for p in ports]
    return "allow-metrics-scrape", {
        "podSelector": dict(pod_selector or {}),
        "policyTypes": ["Ingress"],
        "ingress": [{
            "from": [{"namespaceSelector": {"matchLabels": {NS_NAME_LABEL: naming.MONITORING_NAMESPACE}}}],
            "ports": port_list,
        }],
    }


def allow_to_cache() -> Policy:
    """Egress from a team namespace to the Alluxio S3 proxy."""
    return "allow-cache", {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [{
            "to": [{"namespaceSelector": {"matchLabels": {NS_NAME_LABEL: naming.CACHE_NAMESPACE}}}],
            "ports": [{"protocol": "TCP", "port": naming.CACHE_PROXY_PORT}],
        }],
    }


def allow_mlflow() -> Policy:
    """Egress from a team namespace to the MLflow tracking server."""
    return "allow-mlflow", {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [{
            "to": [{"namespaceSelector": {"matchLabels": {NS_NAME_LABEL: naming.MLFLOW_NAMESPACE}}}],
            "ports": [{"protocol": "TCP", "port": naming.MLFLOW_PORT}],
        }],
    }


def allow_jobset_peers() -> Policy:
    """All TCP between a JobSet's pods in the namespace: torchrun's c10d store (29400) and NCCL's
    ephemeral socket ports, which cannot be listed in advance."""
    jobset_pods = {"matchExpressions": [{"key": JOBSET_NAME_LABEL, "operator": "Exists"}]}
    return "allow-jobset-peers", {
        "podSelector": jobset_pods,
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [{"podSelector": jobset_pods}], "ports": [{"protocol": "TCP"}]}],
        "egress": [{"to": [{"podSelector": jobset_pods}], "ports": [{"protocol": "TCP"}]}],
    }


def network_policies(namespace_name: str, policies: Sequence[Policy], platform: ClusterPlatform,
                     parent: pulumi.Resource, depends_on: Sequence[pulumi.Resource] = (), **names: Any
                     ) -> list[k8s.networking.v1.NetworkPolicy]:
    """Create the given policies in a namespace (the first must be default-deny)."""
    if not policies or policies[0][0] != default_deny()[0]:
        raise ValueError(f"namespace {namespace_name!r}: the first NetworkPolicy must be default-deny-all")
    return network_policy_holes(namespace_name, policies, platform, parent, depends_on, **names)


def network_policy_holes(namespace_name: str, policies: Sequence[Policy], platform: ClusterPlatform,
                         parent: pulumi.Resource, depends_on: Sequence[pulumi.Resource] = (), *,
                         labels: Mapping[str, str] | None = None, prefix: str = ""
                         ) -> list[k8s.networking.v1.NetworkPolicy]:
    """Create policies in a namespace whose default deny is already there (made by network_policies, here or in
    another component). Resources are named `<prefix>-<policy>`, by default `netpol-<namespace>-<policy>`."""
    return [
        k8s.networking.v1.NetworkPolicy(
            f"{prefix or f'netpol-{namespace_name}'}-{name}",
            metadata={"name": name, "namespace": namespace_name, **({"labels": dict(labels)} if labels else {})},
            spec=spec,
            opts=k8s_opts(platform, parent, depends_on))
        for name, spec in policies
    ]
