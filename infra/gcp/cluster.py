"""GKE Standard cluster: private nodes, Workload Identity, Dataplane V2, CMEK, system pool.

Usage (inside the Pulumi program; `build_platform` does this):
    cluster = GkeCluster("cluster", GkeClusterArgs(stack=cfg.stack, project=..., region=..., zones=...,
                         settings=cfg.cluster, vpc_cidr=..., security_group=gke_security_group(cfg.teams),
                         node_repair=True, deletion_protection=True, labels=tags, network=net.network,
                         subnet=net.subnet, database_key=..., disk_key=..., multi_networking=True,
                         registry=reg.repository), opts)
    cluster.location   # the region (regional control plane) or zones[0]; the GPU pools live there too
    cluster.provider   # pulumi_kubernetes provider for everything in infra/k8s/
    cluster.node_service_account.email   # GPU pools use the same least-privilege account
    cluster.dns_endpoint   # gke-<id>.<location>.gke.goog, what the kubeconfig talks to

Control plane access: the IP endpoint stays private (unless `cluster.endpointPublicAccess`), and
the DNS-based endpoint is on with external traffic allowed. Every request to it is authorized by
IAM (`container.clusters.connect`) before Kubernetes RBAC sees it, so `pulumi up` from CI or a
laptop reaches the API server without a public IP, a bastion or an allow-listed address
(https://cloud.google.com/kubernetes-engine/docs/concepts/network-isolation).
The stack's kubeconfig therefore names the DNS endpoint; its certificate is publicly trusted, so
the kubeconfig carries no CA bundle.

Team groups in Kubernetes RBAC (infra/k8s/tenancy.py binds `Group` subjects by e-mail) only work
with Google Groups for RBAC: the cluster names the `gke-security-groups@<domain>` group that the
team groups are members of (https://cloud.google.com/kubernetes-engine/docs/how-to/google-groups-rbac).

`kubeconfig(...)`, `location(...)`, `authorized_networks(...)` and `maintenance_exclusion()` are pure and
tested without mocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.settings import ClusterSettings
from infra.gcp.network import POD_RANGE, SERVICE_RANGE

# Only what a node needs: ship logs and metrics, read images
# (https://cloud.google.com/kubernetes-engine/docs/how-to/hardening-your-cluster#use_least_privilege_sa).
NODE_ROLES = (
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
)
REGISTRY_READER = "roles/artifactregistry.reader"
DEFAULT_SYSTEM_MACHINE = "e2-standard-4"
# A fixed start keeps the exclusion stable between runs; the exclusion lasts until the cluster's
# minor version leaves support, so a run is never interrupted by a minor or node upgrade
# (https://cloud.google.com/kubernetes-engine/docs/concepts/maintenance-windows-and-exclusions).
EXCLUSION_START = "2025-01-01T00:00:00Z"
EXCLUSION_NAME = "no-minor-or-node-upgrades"
# Patch upgrades of the control plane are still allowed, on weekend nights (UTC).
WINDOW_START, WINDOW_END, WINDOW_RECURRENCE = ("2025-01-04T02:00:00Z", "2025-01-04T08:00:00Z",
                                               "FREQ=WEEKLY;BYDAY=SA,SU")


def location(region: str, zones: Sequence[str], regional: bool) -> str:
    """Regional control plane (three replicas) or zonal (zones[0]) per cluster.regional."""
    return region if regional else zones[0]


def workload_pool(project: str) -> str:
    return f"{project}.svc.id.goog"


def authorized_networks(vpc_cidr: str, cluster: ClusterSettings) -> list[dict[str, str]]:
    """Who may reach the API server: the node network always, plus the configured CIDRs when
    the public endpoint is on (config validation already refuses 0.0.0.0/0)."""
    nets = [{"cidr_block": vpc_cidr, "display_name": "nodes"}]
    if cluster.endpoint_public_access:
        nets += [{"cidr_block": c, "display_name": f"operators-{i}"}
                 for i, c in enumerate(cluster.public_access_cidrs)]
    return nets


def maintenance_exclusion() -> gcp.container.ClusterMaintenancePolicyMaintenanceExclusionArgsDict:
    """The cluster's standing exclusion: no minor or node upgrades until the version's end of support."""
    return {"exclusion_name": EXCLUSION_NAME, "start_time": EXCLUSION_START,
            "exclusion_options": {"scope": "NO_MINOR_OR_NODE_UPGRADES",
                                  "end_time_behavior": "UNTIL_END_OF_SUPPORT"}}


def kubeconfig(name: str, dns_endpoint: str) -> str:
    """A kubeconfig for the DNS-based endpoint that authenticates with gke-gcloud-auth-plugin
    (no static credentials; the endpoint's certificate is publicly trusted, so no CA bundle)."""
    if not dns_endpoint:
        raise ValueError(f"cluster {name} has no DNS-based control-plane endpoint to write a kubeconfig for")
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": name, "preferences": {},
        "clusters": [{"name": name, "cluster": {"server": f"https://{dns_endpoint}"}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "users": [{"name": name, "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": "gke-gcloud-auth-plugin",
            "provideClusterInfo": True,
            "interactiveMode": "Never",
            "installHint": "Install gke-gcloud-auth-plugin: gcloud components install gke-gcloud-auth-plugin",
        }}}],
    }
    return json.dumps(doc, indent=2)


def shielded_config() -> gcp.container.NodePoolNodeConfigShieldedInstanceConfigArgs:
    return gcp.container.NodePoolNodeConfigShieldedInstanceConfigArgs(enable_secure_boot=True,
                                                                      enable_integrity_monitoring=True)


@dataclass(frozen=True, kw_only=True)
class GkeClusterArgs:
    stack: str  # the Pulumi stack name (names the cluster and the node service account)
    project: str  # GCP project id (also names the Workload Identity pool)
    region: str  # the cluster's region (its location when regional; the registry's location)
    zones: Sequence[str]  # node zones of a regional cluster; zones[0] is a zonal cluster's location
    settings: ClusterSettings  # gpu-train:cluster (version, channel, endpoint access, system pool, ranges)
    vpc_cidr: str  # the node range, always allowed to reach the API server
    security_group: str | None  # Google Groups for RBAC group (settings_checks.gke_security_group); None: off
    node_repair: bool  # node auto-repair of the system pool (gpu-train:health.nodeRepair)
    deletion_protection: bool  # prod: the cluster cannot be deleted
    labels: dict[str, str]  # common labels (GCE resource labels on the cluster and its nodes)
    network: gcp.compute.Network  # the cluster VPC
    subnet: gcp.compute.Subnetwork  # the node subnet with the pods/services secondary ranges
    database_key: pulumi.Input[str]  # KMS key for etcd application-layer secrets encryption
    disk_key: pulumi.Input[str]  # KMS key for node boot disks
    multi_networking: bool  # turn on GKE multi-networking (needed by fabric pools)
    registry: gcp.artifactregistry.Repository  # nodes may pull from it (and only it, of ours)


class GkeCluster(pulumi.ComponentResource):
    """The GKE control plane, the node service account, the system pool and a k8s provider."""

    def __init__(self, name: str, args: GkeClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:GkeCluster", name, None, opts)
        project = args.project
        self.location = location(args.region, args.zones, args.settings.regional)
        self._node_identity(name, args)
        self._control_plane(name, args)
        self._system_pool(name, args)
        self.dns_endpoint = self.cluster.control_plane_endpoints_config.apply(
            lambda c: c.dns_endpoint_config.endpoint if c and c.dns_endpoint_config else "")
        self.kubeconfig = pulumi.Output.secret(pulumi.Output.all(self.cluster.name, self.dns_endpoint).apply(
            lambda a: kubeconfig(f"gke_{project}_{self.location}_{a[0]}", a[1])))
        self.provider = k8s.Provider(f"{name}-k8s", kubeconfig=self.kubeconfig,
                                     enable_server_side_apply=True,
                                     opts=pulumi.ResourceOptions(parent=self, depends_on=[self.system_pool]))
        self.register_outputs({"name": self.cluster.name, "dns_endpoint": self.dns_endpoint,
                               "node_service_account": self.node_service_account.email})

    def _node_identity(self, name: str, args: GkeClusterArgs) -> None:
        """The nodes' service account, its project roles and its right to pull from the registry."""
        project, stack = args.project, args.stack
        child = pulumi.ResourceOptions(parent=self)
        self.node_service_account = gcp.serviceaccount.Account(
            f"{name}-nodes", account_id=naming.resource_name(stack, "nodes", max_len=30), project=project,
            display_name=f"GKE nodes of {stack}", opts=child)
        node_member = self.node_service_account.email.apply(lambda e: f"serviceAccount:{e}")
        self.node_roles = [gcp.projects.IAMMember(f"{name}-nodes-{role.split('/')[1]}", project=project,
                                                  role=role, member=node_member, opts=child)
                           for role in NODE_ROLES]
        self.node_roles.append(gcp.artifactregistry.RepositoryIamMember(
            f"{name}-nodes-registry-reader", project=project, location=args.region,
            repository=args.registry.name, role=REGISTRY_READER, member=node_member, opts=child))

    def _control_plane(self, name: str, args: GkeClusterArgs) -> None:
        """The private, CMEK-encrypted cluster with Workload Identity, its maintenance window and exclusion."""
        c, project, stack = args.settings, args.project, args.stack
        self.cluster = gcp.container.Cluster(
            f"{name}-gke", name=naming.resource_name(stack, "gke", max_len=40), project=project,
            location=self.location, node_locations=list(args.zones) if c.regional else None,
            network=args.network.id, subnetwork=args.subnet.id,
            ip_allocation_policy=gcp.container.ClusterIpAllocationPolicyArgs(
                cluster_secondary_range_name=POD_RANGE, services_secondary_range_name=SERVICE_RANGE),
            private_cluster_config=gcp.container.ClusterPrivateClusterConfigArgs(
                enable_private_nodes=True, enable_private_endpoint=not c.endpoint_public_access,
                master_ipv4_cidr_block=c.master_cidr),
            control_plane_endpoints_config=gcp.container.ClusterControlPlaneEndpointsConfigArgs(
                dns_endpoint_config=gcp.container.ClusterControlPlaneEndpointsConfigDnsEndpointConfigArgs(
                    allow_external_traffic=True)),
            authenticator_groups_config=gcp.container.ClusterAuthenticatorGroupsConfigArgs(
                security_group=args.security_group) if args.security_group else None,
            master_authorized_networks_config=gcp.container.ClusterMasterAuthorizedNetworksConfigArgs(
                cidr_blocks=[gcp.container.ClusterMasterAuthorizedNetworksConfigCidrBlockArgs(**n)
                             for n in authorized_networks(args.vpc_cidr, c)],
                gcp_public_cidrs_access_enabled=False),
            database_encryption=gcp.container.ClusterDatabaseEncryptionArgs(state="ENCRYPTED",
                                                                            key_name=args.database_key),
            workload_identity_config=gcp.container.ClusterWorkloadIdentityConfigArgs(
                workload_pool=workload_pool(project)),
            enable_shielded_nodes=True,
            datapath_provider="ADVANCED_DATAPATH",
            enable_multi_networking=args.multi_networking or None,
            release_channel=gcp.container.ClusterReleaseChannelArgs(channel=c.release_channel),
            min_master_version=c.kubernetes_version,
            maintenance_policy=gcp.container.ClusterMaintenancePolicyArgs(
                recurring_window=gcp.container.ClusterMaintenancePolicyRecurringWindowArgs(
                    start_time=WINDOW_START, end_time=WINDOW_END, recurrence=WINDOW_RECURRENCE),
                maintenance_exclusions=[maintenance_exclusion()]),
            addons_config=gcp.container.ClusterAddonsConfigArgs(
                gce_persistent_disk_csi_driver_config=gcp.container.ClusterAddonsConfigGcePersistentDiskCsiDriverConfigArgs(
                    enabled=True)),
            logging_config=gcp.container.ClusterLoggingConfigArgs(
                enable_components=["SYSTEM_COMPONENTS", "WORKLOADS"]),
            monitoring_config=gcp.container.ClusterMonitoringConfigArgs(enable_components=["SYSTEM_COMPONENTS"]),
            # The default pool only exists while the cluster is created; it is then deleted in
            # favour of the pools below, but it still gets the hardened node settings.
            remove_default_node_pool=True, initial_node_count=1,
            node_config=gcp.container.ClusterNodeConfigArgs(
                service_account=self.node_service_account.email,
                oauth_scopes=["https://www.googleapis.com/auth/cloud-platform"],
                boot_disk_kms_key=args.disk_key,
                shielded_instance_config=gcp.container.ClusterNodeConfigShieldedInstanceConfigArgs(
                    enable_secure_boot=True, enable_integrity_monitoring=True),
                workload_metadata_config=gcp.container.ClusterNodeConfigWorkloadMetadataConfigArgs(
                    mode="GKE_METADATA")),
            resource_labels=args.labels,
            deletion_protection=args.deletion_protection,
            opts=pulumi.ResourceOptions(parent=self, depends_on=self.node_roles,
                                        ignore_changes=["nodeConfig", "initialNodeCount"]))

    def _system_pool(self, name: str, args: GkeClusterArgs) -> None:
        """The system nodes' pool (the platform's controllers run there)."""
        c, project = args.settings, args.project
        self.system_pool = gcp.container.NodePool(
            f"{name}-system", name="system", project=project, location=self.location,
            cluster=self.cluster.name,
            initial_node_count=c.system_nodes_min,
            autoscaling=gcp.container.NodePoolAutoscalingArgs(
                total_min_node_count=c.system_nodes_min, total_max_node_count=c.system_nodes_max,
                location_policy="BALANCED"),
            management=gcp.container.NodePoolManagementArgs(auto_repair=args.node_repair, auto_upgrade=True),
            node_config=gcp.container.NodePoolNodeConfigArgs(
                machine_type=c.system_node_type or DEFAULT_SYSTEM_MACHINE,
                image_type="COS_CONTAINERD", disk_type="pd-balanced", disk_size_gb=100,
                boot_disk_kms_key=args.disk_key,
                service_account=self.node_service_account.email,
                oauth_scopes=["https://www.googleapis.com/auth/cloud-platform"],
                labels={naming.SYSTEM_LABEL: "true"},
                resource_labels=args.labels,
                shielded_instance_config=shielded_config(),
                workload_metadata_config=gcp.container.NodePoolNodeConfigWorkloadMetadataConfigArgs(
                    mode="GKE_METADATA"),
                gvnic=gcp.container.NodePoolNodeConfigGvnicArgs(enabled=True)),
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["initialNodeCount"]))
