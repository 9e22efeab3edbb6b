"""What EKS's GPU nodes need and give, for the platform contract: pools as jobs see them and the node add-ons.

Usage:
    pools = gpu_pools(settings)                       # before any resource: EFA devices from the catalog
    pools = gpu_pools(settings, cards)                # in build_platform: EFA devices from the EC2 API
    addons = node_addons(pools)                       # for ClusterPlatform.node_addons

The EKS-optimized NVIDIA AMI (AL2023) brings the driver and the container toolkit, so the platform installs
NVIDIA's device plugin and GPU feature discovery (infra/k8s/gpu.py) and, on EFA pools, the EFA device plugin
(https://github.com/aws/eks-charts/tree/master/stable/aws-efa-k8s-device-plugin), which advertises
`vpc.amazonaws.com/efa`. nodeadm assembles and mounts the instance store itself (infra/aws/gpu_nodes.py
NVME_HOST_PATH), so there are no raw devices to RAID.

A node's allocatable follows the EKS AMI's and Karpenter's kubeReservedResources: kube-reserved CPU of 6% of the
first core, 1% of the second, 0.5% of the next two and 0.25% above four; memory 11 MiB per pod + 255 MiB, where
the kubelet's maxPods comes from the VPC CNI's ENI table (misc/eni-max-pods.txt of
github.com/aws/amazon-vpc-cni-k8s, v1.23.0); plus the 100 MiB eviction threshold, with the instance's memory taken
7.5% below nominal (Karpenter's VM_MEMORY_OVERHEAD_PERCENT, pkg/providers/instancetype/types.go).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction

from gpu_train.spec import naming
from gpu_train.spec.catalog.aws import instance_spec
from gpu_train.spec.contract import Allocatable, GpuPool
from gpu_train.spec.settings import StackSettings
from infra.aws.gpu_nodes import EFA_RESOURCE, fabric_for
from infra.platform import DevicePlugin, FabricProbe, NodeAddons, left_for_pods

GIB = 2**30
MIB = 2**20
ENI_MAX_PODS = {
    "p4d.24xlarge": 737, "p4de.24xlarge": 737, "p5.48xlarge": 100, "p5e.48xlarge": 100, "p5en.48xlarge": 198,
    "trn1.32xlarge": 247, "g6e.48xlarge": 492, "g6e.12xlarge": 292, "g6e.xlarge": 58, "g6e.2xlarge": 58,
    "g6.xlarge": 58, "g6.2xlarge": 58, "g6.12xlarge": 234, "g5.xlarge": 58, "g5.48xlarge": 345,
}
_CPU_TIERS = ((0, 1, Fraction(6, 100)), (1, 2, Fraction(1, 100)), (2, 4, Fraction(5, 1000)),
              (4, 1 << 31, Fraction(25, 10000)))
VM_MEMORY_OVERHEAD = Fraction(75, 1000)
EVICTION_MEMORY = 100 * MIB
# https://github.com/aws/eks-charts/tree/master/stable/aws-efa-k8s-device-plugin
EFA_PLUGIN = DevicePlugin(fabric="efa", release="aws-efa-k8s-device-plugin", chart="aws-efa-k8s-device-plugin",
                          version="v0.5.30", repo="https://aws.github.io/eks-charts")


def kubelet_allocatable(instance_type: str) -> tuple[Fraction, Fraction]:
    """(cores, bytes) the kubelet offers to pods on a node of this instance type."""
    spec = instance_spec(instance_type)
    max_pods = ENI_MAX_PODS.get(instance_type, max(ENI_MAX_PODS.values()))
    cpu = Fraction(spec.vcpus) - sum((Fraction(max(0, min(spec.vcpus, end) - start)) * pct
                                      for start, end, pct in _CPU_TIERS), Fraction(0))
    memory = Fraction(spec.memory_gib * GIB) * (1 - VM_MEMORY_OVERHEAD)
    return cpu, memory - Fraction((11 * max_pods + 255) * MIB) - EVICTION_MEMORY


def allocatable(instance_type: str) -> Allocatable:
    """What a GPU node of this instance type leaves to a training pod."""
    return left_for_pods(*kubelet_allocatable(instance_type))


def gpu_pools(s: StackSettings, network_cards: Mapping[str, int] | None = None) -> list[GpuPool]:
    """Every GPU pool as a job sees it. `network_cards` (fabric pool name -> network cards) carries what EC2 reports
    at deploy time, which sets the EFA devices; without it they come from the catalog's network cards, which is what
    the checks before any resource use (neither Kueue nor a node's fit counts EFA devices)."""
    out = []
    for p in s.gpu_pools:
        spec = instance_spec(p.instance_type)
        cards = network_cards[p.name] if network_cards is not None and p.fabric else spec.network_cards
        fabric = fabric_for(p, cards)
        out.append(GpuPool(
            name=p.name, instance_type=p.instance_type, capacity=p.capacity, gpu_type=spec.gpu_type,
            gpus_per_node=spec.gpus, min_nodes=p.min_nodes, max_nodes=p.max_nodes, zone=p.zone,
            node_selector={naming.POOL_LABEL: p.name}, tolerations=naming.gpu_tolerations(), fabric=fabric,
            provisioner="karpenter", allocatable=allocatable(p.instance_type)))
    return out


def node_addons(pools: Sequence[GpuPool]) -> NodeAddons:
    """EKS's GPU node add-ons: NVIDIA's device plugin everywhere, the EFA plugin where a pool has EFA."""
    probes = {p.name: FabricProbe(probe="efa", devices=int(p.fabric.resources.get(EFA_RESOURCE, 0)))
              if p.fabric.kind == "efa" else FabricProbe(probe="none", devices=0) for p in pools}
    return NodeAddons(device_plugin=True,
                      device_plugins=[EFA_PLUGIN] if any(p.fabric.kind == "efa" for p in pools) else [],
                      fabric_probes=probes)
