"""The cloud-neutral Kubernetes layer: GPU plugins, NVMe setup, Alluxio cache, monitoring, Kueue/JobSet tenancy,
MLflow and serving, built from the ClusterPlatform (what the cloud layer made) and the stack's settings.

Usage (infra/__main__.py):
    from infra.k8s import build_kubernetes
    kube = build_kubernetes(platform, cfg, image=image.ref)
    # kube.cache_endpoint, kube.local_queue[team], kube.team_namespaces[team], kube.mlflow, kube.ready, ...

It reads only `platform`, the platform image (serving's routes and promotion loops run it) and cfg.cache /
cfg.monitoring / cfg.health / cfg.mlflow / cfg.serving / cfg.teams / cfg.is_prod / the stack's tags /
cfg.image.prebuilt and cfg.image.allowedRegistries (the image repository and registries the team namespaces'
admission policies accept besides the platform registry). See docs/kubernetes.md and docs/monitoring.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.pod_rules import SERVING_IMAGES, repository_of
from gpu_train.spec.settings import StackSettings
from infra.k8s import common
from infra.k8s.cache import Cache, CacheArgs
from infra.k8s.gpu import GpuStack, GpuStackArgs
from infra.k8s.health import Health, HealthArgs
from infra.k8s.log_shipping import LogShipper, LogShipperArgs
from infra.k8s.mlflow import MlflowServer, MlflowServerArgs
from infra.k8s.monitoring import Monitoring, MonitoringArgs, release_labels
from infra.k8s.nvme import NvmeSetup, NvmeSetupArgs
from infra.k8s.pod_admission import PodAdmission, PodAdmissionArgs
from infra.k8s.serving import NAMESPACES as SERVING_NAMESPACES
from infra.k8s.serving import Serving, ServingArgs
from infra.k8s.storage import EncryptedStorage, StorageArgs
from infra.k8s.tenancy import Tenancy, TenancyArgs
from infra.platform import ClusterPlatform


@dataclass(frozen=True)
class KubernetesLayer:
    """What the job, the published contract and the stack outputs need from the Kubernetes layer."""

    cache_endpoint: str  # S3 endpoint of the Alluxio proxy ("" when the cache is disabled)
    grafana_url: pulumi.Output[str]  # internal LB URL, or the kubectl port-forward command
    team_namespaces: Mapping[str, k8s.core.v1.Namespace]  # team -> its Namespace
    local_queue: Mapping[str, str]  # team -> LocalQueue name in the team namespace
    monitoring_release_label: Mapping[str, str]  # labels a PodMonitor/ServiceMonitor needs
    ready: Sequence[pulumi.Resource]  # what a job should depend_on (Kueue, JobSet, CRDs, namespaces)
    monitoring: Monitoring
    tenancy: Tenancy
    gpu: GpuStack
    cache: Cache | None
    nvme: NvmeSetup  # NVMe RAID0 (where needed) and per-team work directories on every GPU node
    # The pack's pod rules enforced in team namespaces (ValidatingAdmissionPolicies)
    pod_admission: PodAdmission | None = None
    log_shipper: LogShipper | None = None  # container logs to platform.log_store (None: the cloud ships them)
    health: Health | None = None  # GPU node fault detection, quarantine and pre-flight (docs/operations.md)
    mlflow: MlflowServer | None = None  # cfg.mlflow.enabled
    serving: Serving | None = None  # cfg.serving.enabled (the settings checks refuse serving without MLflow)

    @property
    def tracking_uri(self) -> pulumi.Input[str]:
        return self.mlflow.tracking_uri if self.mlflow is not None else ""


def build_kubernetes(platform: ClusterPlatform, cfg: StackSettings, image: pulumi.Input[str]) -> KubernetesLayer:
    """Build every Kubernetes-side component for one stack."""
    if not platform.gpu_pools:
        raise ValueError("platform.gpu_pools is empty: the Kubernetes layer needs at least one GPU pool")
    storage = EncryptedStorage("storage", StorageArgs(platform=platform, retain=cfg.is_prod))

    gpu = GpuStack("gpu", GpuStackArgs(platform=platform, namespace=common.GPU_NAMESPACE))
    team_ns_names = tuple(naming.team_namespace(t.name) for t in cfg.teams)
    # Every GPU node: the RAID0 where the cloud leaves raw disks, and each team's work directory,
    # which training pods mount with hostPath type Directory.
    nvme = NvmeSetup("nvme", NvmeSetupArgs(platform=platform, namespace=common.GPU_NAMESPACE,
                                           team_namespaces=team_ns_names, depends_on=(gpu.namespace,)))
    monitoring = Monitoring("monitoring", MonitoringArgs(
        platform=platform, settings=cfg.monitoring, storage_class=storage.name,
        team_namespaces=team_ns_names, is_prod=cfg.is_prod, depends_on=(storage,), health=cfg.health,
        extra_namespaces=SERVING_NAMESPACES if cfg.serving.enabled else ()))
    health = Health("health", HealthArgs(platform=platform, settings=cfg.health, is_prod=cfg.is_prod,
                                         monitoring_labels=release_labels(), agent_namespace=common.GPU_NAMESPACE,
                                         depends_on=(monitoring.release, gpu.namespace)))

    cache = None
    if cfg.cache.enabled:
        cache = Cache("cache", CacheArgs(
            platform=platform, settings=cfg.cache, storage_class=storage.name,
            monitoring_labels=release_labels(),
            depends_on=(storage, monitoring.release, nvme)))

    tenancy = Tenancy("tenancy", TenancyArgs(platform=platform, teams=tuple(cfg.teams),
                                             cache_enabled=cfg.cache.enabled, serving=cfg.serving.enabled))
    # Team namespaces run at Pod Security "privileged" (NVMe hostPath, GPUDirect sidecars); these policies hold
    # whatever a team submits to the policy pack's pod rules.
    pod_admission = PodAdmission("pod-admission", PodAdmissionArgs(
        platform=platform, extra_repositories=(repository_of(cfg.image.prebuilt),) if cfg.image.prebuilt else (),
        serving_images={k: sorted(v) for k, v in SERVING_IMAGES.items()} if cfg.serving.enabled else {},
        extra_registries=cfg.image.allowed_registries))
    log_shipper = (LogShipper("log-shipper", LogShipperArgs(platform=platform))
                   if platform.log_store is not None else None)

    ready: list[pulumi.Resource] = [
        tenancy.releases["kueue"], tenancy.releases["jobset"], *tenancy.cluster_queues,
        *tenancy.team_namespaces.values(), *tenancy.service_accounts.values(), monitoring.release, gpu, nvme,
        pod_admission,
        health,
    ]
    mlflow = None
    if cfg.mlflow.enabled:
        mlflow = MlflowServer("mlflow", MlflowServerArgs(
            platform=platform, settings=cfg.mlflow, storage_class=storage.name,
            labels=naming.common_tags(cfg.stack, cfg.environment, cfg.tags), db_instances=2 if cfg.is_prod else 1,
            depends_on=[*platform.ready, *ready]))
    serving = None
    if cfg.serving.enabled and mlflow is not None:
        serving = Serving("serving", ServingArgs(
            platform=platform, settings=cfg.serving, teams=[t.name for t in cfg.teams], image=image,
            tracking_uri=mlflow.tracking_uri, artifacts_root=mlflow.artifacts_destination,
            depends_on=[*ready, mlflow]))
    return KubernetesLayer(
        cache_endpoint=cache.endpoint if cache else "",
        grafana_url=monitoring.grafana_url,
        team_namespaces=dict(tenancy.team_namespaces),
        local_queue=dict(tenancy.local_queue),
        monitoring_release_label=release_labels(),
        ready=ready,
        monitoring=monitoring,
        tenancy=tenancy,
        gpu=gpu,
        cache=cache,
        nvme=nvme,
        pod_admission=pod_admission,
        log_shipper=log_shipper,
        health=health,
        mlflow=mlflow,
        serving=serving,
    )
