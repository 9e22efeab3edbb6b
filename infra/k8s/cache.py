"""Alluxio as a read cache in front of the datasets bucket: workers on the GPU nodes keep a page
store on local NVMe; the S3-compatible proxy is the one endpoint the trainer reads from.

Usage: `Cache("cache", CacheArgs(platform=..., settings=cfg.cache, storage_class=..., ...))`;
`cache.endpoint` is the URL for the trainer's `data.endpoint_url` / TRAINER_S3_ENDPOINT_URL.
Helm values are the pure function `alluxio_values(...)`. Chart: Alluxio 2.9 open-source chart
(https://github.com/Alluxio/alluxio/tree/release-2.9/integration/kubernetes/helm-chart/alluxio),
whose workers support the paged block store (`alluxio.worker.block.store.type=PAGE`) and whose
proxy serves the S3 REST API at /api/v1/s3 (https://docs.alluxio.io/os/user/2.9.5/en/api/S3-API.html).

What this chart offers, and so how the values are shaped (checked against its snapshot in
tests/schemas/charts by tests/tools/validation):
- The page store lives on the node's NVMe through the chart's only host-storage option, a
  `tieredstore.levels[]` entry of `type: hostPath` (the chart mounts `path` from the host at the same
  path; `extraVolumes` would silently become an emptyDir). The page-store properties point at it.
- Workers are placed by `worker.nodeSelector` and `worker.tolerations` only (the chart has no
  affinity), so the selector is the set of node labels every GPU pool's nodes carry.
- JVM options are lists (the chart `concat`s them; a string fails the render).
- The worker runs as ALLUXIO_UID; the NVMe DaemonSet (infra/k8s/nvme.py) creates the page-store
  directory owned by it, because a hostPath the kubelet creates is root's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.settings import CacheSettings
from infra.k8s import common
from infra.platform import ClusterPlatform, GpuPool

CHART = "alluxio"
CHART_VERSION = "0.6.54"
ALLUXIO_VERSION = "2.9.5"
REPO = f"https://alluxio-charts.storage.googleapis.com/openSource/{ALLUXIO_VERSION}"
IMAGE = "alluxio/alluxio"
RELEASE = "alluxio"
S3_API_PATH = "/api/v1/s3"
MASTER_WEB_PORT = 19999
WORKER_WEB_PORT = 30000
JOB_MASTER_WEB_PORT = 20002
JOB_WORKER_WEB_PORT = 30003
METRICS_PATH = "/metrics/prometheus/"
# Labels the chart puts on its pods (templates/*: app=<chart name>, release=<release>, role=...).
POD_LABELS = {"app": "alluxio", "release": RELEASE}
# The user and group the chart runs Alluxio as (its values.yaml default, set explicitly so the page
# store directory can be created for exactly this owner).
ALLUXIO_UID = 1000
PAGE_STORE_DIR = "alluxio"  # under the node's NVMe root
PROXY_LABELS = {**POD_LABELS, "role": "alluxio-proxy"}


def endpoint() -> str:
    """The in-cluster S3 endpoint the trainer uses (data.endpoint_url)."""
    return (f"http://{naming.CACHE_PROXY_SERVICE}.{naming.CACHE_NAMESPACE}.svc.cluster.local:"
            f"{naming.CACHE_PROXY_PORT}{S3_API_PATH}")


def page_store_path(nvme_host_path: str) -> str:
    """Directory of the workers' page store on the node's local NVMe filesystem."""
    return nvme_host_path.rstrip("/") + "/" + PAGE_STORE_DIR


def worker_node_selector(gpu_pools: list[GpuPool]) -> dict[str, str]:
    """The label every node of every GPU pool carries and no other node does (naming.pool_node_labels):
    the chart places workers by nodeSelector only."""
    if not gpu_pools:
        raise ValueError("the cache needs at least one GPU pool for its workers")
    return {naming.GPU_NODE_LABEL: "true"}


def ufs_uri(datasets_bucket: str) -> str:
    """Alluxio's root mount: the datasets bucket (s3://name or gs://name) with a trailing slash."""
    if not datasets_bucket.startswith(("s3://", "gs://")):
        raise ValueError(f"platform.buckets.datasets must be s3://... or gs://... (got {datasets_bucket!r})")
    return datasets_bucket.rstrip("/") + "/"


def alluxio_values(*, settings: CacheSettings, nvme_host_path: str, datasets_bucket: str, region: str,
                   storage_class: str, gpu_pools: list[GpuPool], system_selector: dict[str, str],
                   service_account: str = naming.CACHE_SERVICE_ACCOUNT) -> dict[str, Any]:
    """Helm values for the Alluxio chart. No credentials appear anywhere: the under-storage is read
    with the pods' workload identity (service account `alluxio`) through the SDK default chains."""
    if settings.masters not in (1, 3, 5):
        raise ValueError(f"gpu-train:cache.masters must be 1, 3 or 5 for an embedded-journal quorum "
                         f"(got {settings.masters})")
    if not gpu_pools:
        raise ValueError("the cache needs at least one GPU pool for its workers")
    pages = page_store_path(nvme_host_path)
    quota = f"{settings.page_store_gb}GB"
    worker_selector = worker_node_selector(gpu_pools)
    tolerations = common.gpu_tolerations(gpu_pools)
    properties = {
        "alluxio.master.mount.table.root.ufs": ufs_uri(datasets_bucket),
        # Read-only cache of the bucket: never write back through Alluxio.
        "alluxio.master.mount.table.root.readonly": "true",
        "alluxio.underfs.s3.region": region,
        "alluxio.underfs.gcs.version": "2",
        "alluxio.master.journal.type": "EMBEDDED",
        "alluxio.worker.block.store.type": "PAGE",
        "alluxio.worker.page.store.type": "LOCAL",
        "alluxio.worker.page.store.dirs": pages,
        "alluxio.worker.page.store.sizes": quota,
        "alluxio.worker.page.store.page.size": "4MB",
        "alluxio.user.file.readtype.default": "CACHE",
        "alluxio.user.file.writetype.default": "THROUGH",
        "alluxio.proxy.web.port": str(naming.CACHE_PROXY_PORT),
        "alluxio.security.authentication.type": "NOSASL",
    }
    return {
        "fullnameOverride": "alluxio",
        "image": IMAGE,
        "imageTag": ALLUXIO_VERSION,
        "imagePullPolicy": "IfNotPresent",
        "user": ALLUXIO_UID,
        "group": ALLUXIO_UID,
        "fsGroup": ALLUXIO_UID,
        "serviceAccount": service_account,
        "properties": properties,
        "journal": {
            "type": "EMBEDDED",
            "folder": "/journal",
            "volumeType": "persistentVolumeClaim",
            "storageClass": storage_class,
            "size": f"{settings.journal_gb}Gi",
            "accessModes": ["ReadWriteOnce"],
        },
        "master": {
            "count": settings.masters,
            "nodeSelector": system_selector,
            "resources": common.resources("1", "4Gi", "2", "4Gi"),
            "jvmOptions": ["-Xms2g", "-Xmx2g", "-XX:MaxDirectMemorySize=1g"],
        },
        "jobMaster": {"resources": common.resources("250m", "1Gi", "1", "1Gi")},
        # One tier on the node's NVMe, mounted by the chart as a hostPath; the paged store uses it
        # through alluxio.worker.page.store.dirs (same path, same quota).
        "tieredstore": {"levels": [{
            "level": 0, "alias": "SSD", "mediumtype": "SSD", "type": "hostPath", "path": pages, "quota": quota,
            "high": 0.95, "low": 0.7,
        }]},
        "worker": {
            "nodeSelector": worker_selector,
            "tolerations": tolerations,
            # Pod networking so NetworkPolicies apply; the proxy is the only client (no short-circuit).
            "hostNetwork": False,
            "resources": common.resources("2", "8Gi", "8", "8Gi"),
            "jvmOptions": ["-Xms4g", "-Xmx4g", "-XX:MaxDirectMemorySize=2g"],
        },
        "jobWorker": {"resources": common.resources("250m", "1Gi", "1", "1Gi")},
        "shortCircuit": {"enabled": False},
        "proxy": {
            "enabled": True,
            "hostNetwork": False,
            "nodeSelector": system_selector,
            "ports": {"web": naming.CACHE_PROXY_PORT},
            "resources": common.resources("1", "4Gi", "4", "4Gi"),
        },
        "fuse": {"enabled": False},
        "logserver": {"enabled": False},
        "metrics": {"enabled": True, "PrometheusMetricsServlet": {"enabled": True}},
    }


def pod_monitor_spec() -> dict[str, Any]:
    """PodMonitor spec scraping Alluxio's Prometheus servlet on every component's web port."""
    return {
        "selector": {"matchLabels": POD_LABELS},
        "namespaceSelector": {"matchNames": [naming.CACHE_NAMESPACE]},
        "podMetricsEndpoints": [
            {"port": port, "path": METRICS_PATH, "interval": "30s"}
            for port in ("web", "job-web")
        ],
    }


def cache_network_policies(platform: ClusterPlatform) -> list[common.Policy]:
    """Default deny; the proxy open to team namespaces; Alluxio's own pods to each other; the
    bucket; metrics scrapes; DNS."""
    proxy_from_teams = ("allow-proxy-from-teams", {
        "podSelector": {"matchLabels": {"role": "alluxio-proxy"}},
        "policyTypes": ["Ingress"],
        "ingress": [{
            "from": [{"namespaceSelector": {"matchExpressions": [
                {"key": naming.TEAM_LABEL, "operator": "Exists"}]}}],
            "ports": [{"protocol": "TCP", "port": naming.CACHE_PROXY_PORT}],
        }],
    })
    return [
        common.default_deny(),
        common.allow_dns(),
        common.allow_same_namespace(),
        common.allow_object_store(platform.object_store_cidrs, platform.workload_identity_egress),
        proxy_from_teams,
        common.allow_metrics_scrape([MASTER_WEB_PORT, WORKER_WEB_PORT, JOB_MASTER_WEB_PORT, JOB_WORKER_WEB_PORT]),
    ]


@dataclass(frozen=True, kw_only=True)
class CacheArgs:
    platform: ClusterPlatform  # NVMe path, datasets bucket, cache identity, pools
    settings: CacheSettings  # cfg.cache
    storage_class: str  # encrypted StorageClass for the masters' journals
    monitoring_labels: dict[str, str]  # labels Prometheus selects monitors by
    depends_on: tuple[pulumi.Resource, ...] = ()  # StorageClass, monitoring CRDs


class Cache(pulumi.ComponentResource):
    """Alluxio (masters, NVMe workers, S3 proxy) in its own namespace."""

    def __init__(self, name: str, args: CacheArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:Cache", name, None, opts)
        p = args.platform
        ns_name = naming.CACHE_NAMESPACE
        # Privileged: the workers mount the page store on the node's NVMe as a hostPath, the chart's only way
        # to give them host storage, and every stricter Pod Security level refuses a hostPath volume
        # (https://kubernetes.io/docs/concepts/security/pod-security-standards/#baseline). Only Alluxio runs here.
        self.namespace = common.namespace(ns_name, p, self, enforce="privileged", depends_on=p.ready)
        ns_deps = [self.namespace]
        self.network_policies = common.network_policies(ns_name, cache_network_policies(p), p, self, ns_deps)

        identity = p.identities.get("cache")
        if identity is None:
            raise ValueError("platform.identities has no 'cache' entry: the cache reads the datasets bucket "
                             "through workload identity and has no other credentials")
        if identity.name != naming.CACHE_SERVICE_ACCOUNT or ns_name not in identity.namespaces:
            raise ValueError(f"platform.identities['cache'] is bound to {list(identity.namespaces)}/"
                             f"{identity.name}, not {ns_name}/{naming.CACHE_SERVICE_ACCOUNT}")
        self.service_account = k8s.core.v1.ServiceAccount(
            f"{name}-sa",
            metadata={"name": identity.name, "namespace": ns_name, "annotations": dict(identity.annotations)},
            opts=common.k8s_opts(p, self, ns_deps))

        values = p.buckets.datasets.apply(lambda bucket: alluxio_values(
            settings=args.settings, nvme_host_path=p.nvme_host_path, datasets_bucket=bucket, region=p.region,
            storage_class=args.storage_class, gpu_pools=list(p.gpu_pools),
            system_selector=dict(p.system_node_selector)))
        self.release = common.helm_release(
            f"{name}-alluxio", RELEASE, CHART, CHART_VERSION, REPO, ns_name, values=values,
            # Masters format their journal on first start; don't block `up` on the NVMe nodes existing.
            # PlatformWorkloadUnavailable (rules/workloads.yaml) watches the workers and masters instead.
            skip_await=True,
            opts=common.k8s_opts(p, self, [*ns_deps, self.service_account, *args.depends_on]))

        self.proxy_service = k8s.core.v1.Service(
            f"{name}-proxy-service",
            metadata={"name": naming.CACHE_PROXY_SERVICE, "namespace": ns_name,
                      "labels": {"app.kubernetes.io/name": "alluxio-proxy"}},
            spec={"type": "ClusterIP", "selector": PROXY_LABELS,
                  "ports": [{"name": "s3", "port": naming.CACHE_PROXY_PORT, "targetPort": naming.CACHE_PROXY_PORT,
                             "protocol": "TCP"}]},
            opts=common.k8s_opts(p, self, ns_deps))

        self.pod_monitor = k8s.apiextensions.CustomResource(
            f"{name}-podmonitor",
            api_version="monitoring.coreos.com/v1", kind="PodMonitor",
            metadata={"name": "alluxio", "namespace": ns_name, "labels": dict(args.monitoring_labels)},
            spec=pod_monitor_spec(),
            opts=common.k8s_opts(p, self, [*ns_deps, *args.depends_on]))

        self.endpoint: str = endpoint()
        self.register_outputs({"endpoint": self.endpoint})
