"""GCP cloud layer: `build_platform(cfg, tags)` creates the GKE platform and returns its ClusterPlatform.

Usage (infra/__main__.py does this, before and after its checks):
    pools = infra.gcp.describe_pools(cfg)      # pure: the pools as jobs see them
    problems = infra.gcp.check(cfg)            # the settings only GCP has rules for
    platform = infra.gcp.build_platform(cfg, tags)

`build_platform` is the one place that reads the settings: each component's Args carries only the
values it uses. Every resource gets its project (and region where it has one) passed explicitly and its labels
passed explicitly, so the program never depends on ambient `gcp:project` / `gcp:region` settings
or on provider default labels. Order: APIs -> service agents -> keys and their grants -> network,
storage, registry -> cluster -> GPU pools -> workload identities (the cluster creates the
Workload Identity pool their bindings name) -> (mlflow.database: managed) Cloud SQL.
See docs/gcp.md.
"""

from __future__ import annotations

import pulumi
import pulumi_gcp as gcp

from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool
from gpu_train.spec.settings import StackSettings
from infra.gcp import node_addons, settings_checks
from infra.gcp.cluster import GkeCluster, GkeClusterArgs
from infra.gcp.database import Database, DatabaseArgs
from infra.gcp.gpu_pools import GpuNodePool, GpuNodePoolArgs
from infra.gcp.identity import Identities, IdentitiesArgs, identities
from infra.gcp.keys import Keys, KeysArgs
from infra.gcp.network import (
    PRIVATE_GOOGLE_APIS,
    Network,
    NetworkArgs,
    fabric_sets,
    nat_log_filter,
    pool_fabric_key,
    psa_range,
)
from infra.gcp.registry import ArtifactRegistry, ArtifactRegistryArgs
from infra.gcp.services import ProjectServices, ProjectServicesArgs
from infra.gcp.storage import Storage, StorageArgs
from infra.platform import Buckets, ClusterPlatform, EgressTarget, ManagedDatabase, StorageClassSpec

# Where the Kubernetes layer RAID0s and mounts the GPU nodes' raw local NVMe SSDs. On COS the
# stateful partition is the writable, node-lifetime disk area; GKE's own ephemeral-SSD mode uses a
# sibling directory, so this one never collides with it.
NVME_HOST_PATH = "/mnt/stateful_partition/gpu-train/nvme-raid"
SYSTEM_LABELS = {naming.SYSTEM_LABEL: "true"}  # on the system node pool's nodes; the controllers run there
OBJECT_STORE_ENDPOINT = "https://storage.googleapis.com"
INTERNAL_LB = {"networking.gke.io/load-balancer-type": "Internal"}
# Where pods get Workload Identity tokens: the GKE metadata server, reached at the metadata address
# on port 80 and, on GKE Dataplane V2 clusters, at 169.254.169.252:988. NetworkPolicies with egress
# rules must allow both (https://cloud.google.com/kubernetes-engine/docs/how-to/workload-identity,
# the network-policy note under restrictions).
METADATA_SERVER_EGRESS = (EgressTarget("169.254.169.254/32", 80), EgressTarget("169.254.169.252/32", 988))


def describe_pools(cfg: StackSettings) -> list[GpuPool]:
    """The GPU pools as jobs see them, from the settings alone (infra/gcp/node_addons.py)."""
    return node_addons.gpu_pools(cfg)


def check(cfg: StackSettings) -> list[str]:
    """Problems of the settings on GCP, before anything is created (infra/gcp/settings_checks.py)."""
    return settings_checks.problems(cfg)


def fabric_names(network: Network) -> dict[str, pulumi.Output[str]]:
    """GCE name of every fabric VPC and subnet -> its name as an Output (so a pool waits for them)."""
    names = {next(v.name for v in network.fabric[key].vpcs if v.suffix == suffix): net.name
             for (key, suffix), net in network.fabric_networks.items()}
    names.update({sub_name: sub.name for sub_name, sub in network.fabric_subnets.items()})
    return names


def build_platform(cfg: StackSettings, tags: dict[str, str]) -> ClusterPlatform:
    """The GKE platform, as a ClusterPlatform."""
    labels = dict(tags)
    stack, project_id, region = cfg.stack, cfg.project, cfg.region
    managed_db = cfg.mlflow.enabled and cfg.mlflow.database == "managed"
    apis = ProjectServices("apis", ProjectServicesArgs(project=project_id, managed_database=managed_db))

    def after(*deps: pulumi.Resource) -> pulumi.ResourceOptions:
        """Options of a top-level component: it (and so every child) waits for the APIs and `deps`."""
        return pulumi.ResourceOptions(depends_on=[apis, *deps])

    project = gcp.organizations.get_project_output(
        project_id=project_id,
        opts=pulumi.InvokeOutputOptions(depends_on=[apis.services["cloudresourcemanager.googleapis.com"]]))

    keys = Keys("keys", KeysArgs(stack=stack, project=project_id, region=region, protect=cfg.is_prod,
                                 labels=labels, project_number=project.number,
                                 optional=("sql",) if managed_db else (), apis=apis.services),
                opts=after())
    ranges = cfg.network
    network = Network("network", NetworkArgs(
        stack=stack, project=project_id, region=region, vpc_cidr=ranges.vpc_cidr, pod_cidr=ranges.pod_cidr,
        service_cidr=ranges.service_cidr, master_cidr=cfg.cluster.master_cidr, flow_logs=ranges.flow_logs,
        nat_logs=nat_log_filter(cfg.is_prod), fabric=fabric_sets(cfg), labels=labels), opts=after())
    storage = Storage("storage", StorageArgs(
        stack=stack, project=project_id, region=region, environment=cfg.environment, protect=cfg.is_prod,
        labels=labels, kms_key=keys.key_ids["storage"]), opts=after(keys.grants["storage"]))
    registry = ArtifactRegistry("registry", ArtifactRegistryArgs(
        stack=stack, project=project_id, region=region, labels=labels, kms_key=keys.key_ids["registry"]),
        opts=after(keys.grants["registry"]))
    cluster = GkeCluster(
        "cluster",
        GkeClusterArgs(stack=stack, project=project_id, region=region, zones=cfg.zones, settings=cfg.cluster,
                       vpc_cidr=ranges.vpc_cidr, security_group=settings_checks.gke_security_group(cfg.teams),
                       node_repair=cfg.health.node_repair, deletion_protection=cfg.is_prod, labels=labels,
                       network=network.network, subnet=network.subnet,
                       database_key=keys.key_ids["gke"], disk_key=keys.key_ids["disks"],
                       multi_networking=bool(network.fabric), registry=registry.repository),
        opts=after(keys.grants["gke"], keys.grants["disks"], network.nat))

    names = fabric_names(network)
    pools = [GpuNodePool(
        f"gpu-{p.name}",
        GpuNodePoolArgs(project=project_id, location=cluster.location, zones=cfg.zones,
                        regional=cfg.cluster.regional, node_repair=cfg.health.node_repair, pool=p, labels=labels,
                        cluster=cluster.cluster, service_account=cluster.node_service_account.email,
                        disk_key=keys.key_ids["disks"], networks=names,
                        fabric=network.fabric[k] if (k := pool_fabric_key(p)) else None),
        opts=after(keys.grants["disks"], cluster.system_pool)) for p in cfg.gpu_pools]
    # Workload Identity bindings name the <project>.svc.id.goog pool, which exists once a cluster
    # with Workload Identity does; a binding to a missing pool is refused.
    workload_ids = Identities(
        "identities", IdentitiesArgs(stack=stack, project=project_id, buckets=storage.buckets,
                                     identities=identities([t.name for t in cfg.teams], cfg.serving.enabled)),
        opts=after(cluster.cluster))
    mlflow_database: ManagedDatabase | None = Database("mlflow-db", DatabaseArgs(
        stack=stack, project=project_id, region=region, is_prod=cfg.is_prod, storage_gb=cfg.mlflow.storage_gb,
        psa_cidr=psa_range(cfg), labels=labels, network=network.network, kms_key=keys.key_ids["sql"],
        depends_on=(keys.grants["sql"],)), opts=after()).contract if managed_db else None

    return ClusterPlatform(
        cloud="gcp", region=region, cluster_name=cluster.cluster.name,
        kubernetes_version=cfg.cluster.kubernetes_version, provider=cluster.provider, kubeconfig=cluster.kubeconfig,
        gpu_pools=node_addons.gpu_pools(cfg), system_node_selector=dict(SYSTEM_LABELS),
        nvme_host_path=NVME_HOST_PATH,
        buckets=Buckets(datasets=storage.uris["datasets"], checkpoints=storage.uris["checkpoints"],
                        artifacts=storage.uris["artifacts"]),
        # storage.googleapis.com resolves to private.googleapis.com inside the VPC (network.py).
        object_store_endpoint=OBJECT_STORE_ENDPOINT, object_store_cidrs=[PRIVATE_GOOGLE_APIS],
        api_server_cidrs=[cfg.cluster.master_cidr], vpc_cidr=ranges.vpc_cidr, pod_cidr=ranges.pod_cidr,
        storage_class=StorageClassSpec(
            name="pd-balanced-cmek", provisioner="pd.csi.storage.gke.io",
            parameters={"type": "pd-balanced", "disk-encryption-kms-key": keys.key_ids["disks"]}),
        identities=workload_ids.contract, registry=registry.contract, internal_lb_annotations=INTERNAL_LB,
        ready=[cluster.system_pool, *[p.node_pool for p in pools]],
        workload_identity_egress=list(METADATA_SERVER_EGRESS), mlflow_database=mlflow_database,
        # GKE ships every container's log to Cloud Logging itself.
        logs={"kind": "cloud-logging", "project": project_id, "cluster": cluster.cluster.name},
        node_addons=node_addons.node_addons(cfg, names),
    )
