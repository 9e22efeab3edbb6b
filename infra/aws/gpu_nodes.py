"""What a GPU node of the AWS layer looks like: EFA interface layout, NCCL environment, labels, AMI.

Usage:
    layout = efa_interfaces(32)            # p5.48xlarge: ENA primary + one efa-only interface per card
    fabric_for(pool, cards)                # the platform's Fabric for a pool (EFA resources, NCCL env)
    node_labels(pool, spec)                # the labels every node of the pool carries

Every GPU pool is a Karpenter NodePool (infra/aws/karpenter.py builds the EC2NodeClass and NodePools
from these helpers); the only managed node group left is the system group in infra/aws/cluster.py.
All functions here are pure except `network_cards`, which asks EC2 at deploy time.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from gpu_train.spec import naming
from gpu_train.spec.catalog.aws import InstanceSpec
from gpu_train.spec.contract import Fabric
from gpu_train.spec.settings import GpuPoolSettings

# Where nodeadm's RAID0 local-storage strategy mounts the instance-store array; Karpenter asks for it
# with the EC2NodeClass's instanceStorePolicy RAID0.
NVME_HOST_PATH = "/mnt/k8s-disks/0"
GPU_ROOT_GB = 200  # container images of GPU frameworks are large
EFA_RESOURCE = "vpc.amazonaws.com/efa"
# Instance families whose EFA supports RDMA read/write (GPUDirect RDMA).
# https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa.html#efa-instance-types
RDMA_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "trn1")


@dataclass(frozen=True, kw_only=True)
class Interface:
    network_card_index: int
    device_index: int
    interface_type: str  # "interface" (ENA, has the node's IP) or "efa-only" (EFA device, no IP)


def efa_interfaces(network_cards: int) -> list[Interface]:
    """The interfaces of a fabric node: one EFA device on every network card, one IP per node.

    EC2's recommended layout for instances with several network cards, which is also the only one
    Karpenter's EC2NodeClass accepts (its `networkInterfaces` takes the types "interface" and
    "efa-only", and requires an "interface" at card 0, device 0): an ENA interface at card 0 device 0
    (the node's IP, used by the VPC CNI and kubelet), an efa-only interface at card 0 device 1, and
    an efa-only interface at device 0 of every other card. efa-only interfaces take no subnet
    address, so a p5 uses one IP instead of 32; the node still has one EFA device per card, which
    Karpenter counts as its `vpc.amazonaws.com/efa` capacity. efa-only needs vpc-cni >= 1.18.4.
    https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html
    """
    if network_cards < 1:
        raise ValueError(f"an instance has at least one network card (got {network_cards})")
    return [Interface(network_card_index=0, device_index=0, interface_type="interface"),
            Interface(network_card_index=0, device_index=1, interface_type="efa-only")] + [
        Interface(network_card_index=card, device_index=0, interface_type="efa-only")
        for card in range(1, network_cards)]


def efa_devices(layout: list[Interface]) -> int:
    """EFA devices a layout gives a node (what the EFA device plugin advertises)."""
    return sum(1 for i in layout if i.interface_type == "efa-only")


def network_cards(instance_type: str, opts: pulumi.InvokeOptions | None = None) -> int:
    """Maximum network cards from the EC2 API (deploy time); the catalog is the offline check."""
    info = aws.ec2.get_instance_type(instance_type=instance_type, opts=opts)
    if not info.efa_supported:
        raise ValueError(f"{instance_type} does not support EFA, but its pool has fabric: true")
    cards = int(info.maximum_network_cards)
    if cards < 1:
        raise ValueError(f"EC2 reports {cards} network cards for {instance_type}")
    return cards


def nccl_env(instance_type: str) -> dict[str, str]:
    """libfabric/NCCL settings for EFA (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html)."""
    env = {
        "FI_PROVIDER": "efa",
        # PyTorch DataLoader workers fork; libfabric must register memory fork-safely.
        "FI_EFA_FORK_SAFE": "1",
        # Bootstrap/out-of-band traffic uses the pod's own interface; data goes over EFA.
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_CROSS_NIC": "1",
    }
    if instance_type.split(".")[0] in RDMA_FAMILIES:
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env


def fabric_for(pool: GpuPoolSettings, cards: int) -> Fabric:
    if not pool.fabric:
        return Fabric(kind="none")
    devices = efa_devices(efa_interfaces(cards))
    return Fabric(kind="efa", resources={EFA_RESOURCE: devices}, nccl_env=nccl_env(pool.instance_type))


def node_labels(pool: GpuPoolSettings, spec: InstanceSpec) -> dict[str, str]:
    return {**dict(pool.labels),
            **naming.pool_node_labels(pool.name, pool.capacity, "efa" if pool.fabric else "none", spec.gpu_type)}


def efa_security_group_rules() -> list[dict]:
    """EFA requires all traffic to and from the group itself (self-referencing ingress and egress)."""
    return [{"direction": d, "ip_protocol": "-1", "self": True} for d in ("ingress", "egress")]


def nvidia_ami_parameter(kubernetes_version: str) -> str:
    return f"/aws/service/eks/optimized-ami/{kubernetes_version}/amazon-linux-2023/x86_64/nvidia/recommended/image_id"
