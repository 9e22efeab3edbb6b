"""GKE GPU node pools: one per gpuPools entry, scaled by the cluster autoscaler.

Usage (inside the Pulumi program; `build_platform` does this):
    pool = GpuNodePool(f"gpu-{p.name}", GpuNodePoolArgs(project=cfg.project, location=cluster.location,
                       zones=cfg.zones, regional=True, node_repair=True, pool=p, labels=tags,
                       cluster=cluster.cluster, service_account=..., disk_key=..., fabric=net.fabric.get(key),
                       networks=...), opts)
    pool.node_pool  # the GKE node pool (the pool as jobs see it: infra/gcp/node_addons.py gpu_pools)

The GPU driver version (DEFAULT or LATEST driver of the node's GKE version) is part of the node
template: changing gpuPools[].gpuDriverVersion replaces the pool, which drains and recreates
every node of it, so change it between runs. `capacity_settings`, `autoscaling_settings` and
`node_labels` are pure and tested without mocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_gcp as gcp

from gpu_train.spec import naming
from gpu_train.spec.catalog.gcp import machine_spec
from gpu_train.spec.settings import GpuPoolSettings
from infra.gcp.cluster import shielded_config
from infra.gcp.network import FabricSetPlan

RESERVATION_KEY = "compute.googleapis.com/reservation-name"


def capacity_settings(pool: GpuPoolSettings) -> dict[str, Any]:
    """Node-config fields for spot, on-demand or a specific reservation."""
    if pool.capacity == "spot":
        return {"spot": True}
    if pool.capacity == "reservation":
        return {"reservation_affinity": {"consume_reservation_type": "SPECIFIC_RESERVATION",
                                         "key": RESERVATION_KEY, "values": [pool.reservation_id]}}
    if pool.capacity == "on-demand":
        return {"reservation_affinity": {"consume_reservation_type": "NO_RESERVATION"}}
    raise ValueError(f"gpuPools {pool.name!r}: capacity {pool.capacity!r} is not available on GCP")


def autoscaling_settings(pool: GpuPoolSettings) -> dict[str, Any]:
    """Totals across zones; spot takes capacity wherever it is (ANY), others spread (BALANCED)."""
    return {"total_min_node_count": pool.min_nodes, "total_max_node_count": pool.max_nodes,
            "location_policy": "ANY" if pool.capacity == "spot" else "BALANCED"}


def node_locations(zones: Sequence[str], pool: GpuPoolSettings) -> list[str]:
    """Fabric pools (compact placement) and pinned pools live in one zone; others in all."""
    return [pool.zone] if pool.zone else list(zones)


def node_labels(pool: GpuPoolSettings, fabric_kind: str) -> dict[str, str]:
    spec = machine_spec(pool.instance_type)
    return {**pool.labels, **naming.pool_node_labels(pool.name, pool.capacity, fabric_kind, spec.gpu_type)}


@dataclass(frozen=True, kw_only=True)
class GpuNodePoolArgs:
    project: str  # GCP project id
    location: str  # the cluster's location (GkeCluster.location: its region, or a zone when zonal)
    zones: Sequence[str]  # the stack's zones: node locations of a pool not pinned to one
    regional: bool  # regional cluster: a pool in several zones leaves its initial node count unset
    node_repair: bool  # node auto-repair (gpu-train:health.nodeRepair)
    pool: GpuPoolSettings  # this pool's settings
    labels: dict[str, str]  # common labels (GCE resource labels on the nodes)
    cluster: gcp.container.Cluster  # the cluster the pool belongs to
    service_account: pulumi.Input[str]  # least-privilege node service account email
    disk_key: pulumi.Input[str]  # CMEK for boot disks
    fabric: FabricSetPlan | None  # the fabric VPCs this pool attaches to (None: no fabric)
    networks: dict[str, pulumi.Output[str]]  # GCE network/subnet name -> Output name (dependencies)


class GpuNodePool(pulumi.ComponentResource):
    """One GPU node pool."""

    def __init__(self, name: str, args: GpuNodePoolArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:GpuNodePool", name, None, opts)
        pool, fset = args.pool, args.fabric
        spec = machine_spec(pool.instance_type)
        kind = fset.kind if fset is not None else "none"
        cap = capacity_settings(pool)
        affinity = cap.get("reservation_affinity")
        network_config = None
        if fset is not None:
            network_config = gcp.container.NodePoolNetworkConfigArgs(
                additional_node_network_configs=[
                    gcp.container.NodePoolNetworkConfigAdditionalNodeNetworkConfigArgs(
                        network=args.networks[vpc.name], subnetwork=args.networks[sub.name])
                    for vpc, sub in fset.nics()])
        self.node_pool = gcp.container.NodePool(
            f"{name}-pool", name=pool.name, project=args.project, location=args.location,
            cluster=args.cluster.name, node_locations=node_locations(args.zones, pool),
            initial_node_count=pool.min_nodes if not args.regional or pool.zone else None,
            autoscaling=gcp.container.NodePoolAutoscalingArgs(**autoscaling_settings(pool)),
            placement_policy=gcp.container.NodePoolPlacementPolicyArgs(type="COMPACT")
            if fset is not None else None,
            # Auto-repair (gpu-train:health.nodeRepair) recreates a node that stays NotReady or silent for about
            # 10 minutes; GPU faults are the Kubernetes layer's quarantine (infra/k8s/health.py).
            management=gcp.container.NodePoolManagementArgs(auto_repair=args.node_repair, auto_upgrade=True),
            # Upgrades replace one node at a time with no surge node (spare GPU capacity for a
            # surge node rarely exists, and a reservation has none); the cluster's maintenance
            # exclusion keeps node upgrades away while runs last.
            upgrade_settings=gcp.container.NodePoolUpgradeSettingsArgs(max_surge=0, max_unavailable=1,
                                                                       strategy="SURGE"),
            network_config=network_config,
            node_config=gcp.container.NodePoolNodeConfigArgs(
                machine_type=pool.instance_type,
                image_type="COS_CONTAINERD",
                # The series' own boot disk type (A3 Ultra and A4 accept Hyperdisk only).
                disk_type=spec.boot_disk, disk_size_gb=200,
                boot_disk_kms_key=args.disk_key,
                guest_accelerators=[gcp.container.NodePoolNodeConfigGuestAcceleratorArgs(
                    type=spec.accelerator, count=spec.gpus,
                    gpu_driver_installation_config=gcp.container
                    .NodePoolNodeConfigGuestAcceleratorGpuDriverInstallationConfigArgs(
                        gpu_driver_version=pool.gpu_driver_version))],
                spot=cap.get("spot"),
                reservation_affinity=gcp.container.NodePoolNodeConfigReservationAffinityArgs(**affinity)
                if affinity else None,
                # The machine's local SSDs as raw NVMe block devices; the Kubernetes layer RAID0s
                # and mounts them for the data cache.
                local_nvme_ssd_block_config=gcp.container.NodePoolNodeConfigLocalNvmeSsdBlockConfigArgs(
                    local_ssd_count=spec.local_ssds),
                service_account=args.service_account,
                oauth_scopes=["https://www.googleapis.com/auth/cloud-platform"],
                labels=node_labels(pool, kind),
                resource_labels={**args.labels, "gpu-pool": pool.name},
                taints=[gcp.container.NodePoolNodeConfigTaintArgs(
                    key=naming.GPU_TAINT["key"], value=naming.GPU_TAINT["value"], effect="NO_SCHEDULE")],
                shielded_instance_config=shielded_config(),
                workload_metadata_config=gcp.container.NodePoolNodeConfigWorkloadMetadataConfigArgs(
                    mode="GKE_METADATA"),
                gvnic=gcp.container.NodePoolNodeConfigGvnicArgs(enabled=True)),
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["initialNodeCount"]))

        self.register_outputs({"name": self.node_pool.name})
