"""GPU node groups with EFA: launch templates, placement groups, the EFA security group, user data.

Usage:
    layout = efa_interfaces(32)            # p5.48xlarge: card 0 "efa" + 31 "efa-only"
    user_data = nodeadm_user_data(...)     # MIME multipart NodeConfig (RAID0 NVMe, labels, taints)
    nodes = GpuNodeGroups("gpu", GpuNodeGroupsArgs(...))

Which pools land here (`provisioner_for`): reservation and capacity-block pools (static capacity that
is paid for either way, and Karpenter cannot target a specific ODCR / capacity block as reliably as a
launch template can), and every fabric pool: Karpenter's EC2NodeClass cannot attach N EFA interfaces
per instance, so an EFA pool needs the launch template below. Everything else (non-fabric spot and
on-demand pools) goes to Karpenter (`infra/aws/karpenter.py`).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import yaml

from infra import naming
from infra.aws.catalog import InstanceSpec
from infra.aws.cluster import metadata_options, root_volume
from infra.config import GpuPoolConfig
from infra.platform import Fabric

NVME_HOST_PATH = "/mnt/k8s-disks/0"  # where nodeadm's RAID0 strategy mounts the instance-store array
GPU_ROOT_GB = 200  # container images of GPU frameworks are large
MIME_BOUNDARY = "==gpu-train-nodeadm=="
EFA_RESOURCE = "vpc.amazonaws.com/efa"
# Instance families whose EFA supports RDMA read/write (GPUDirect RDMA).
# https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa.html#efa-instance-types
RDMA_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "trn1")
CAPACITY_TYPES = {"spot": "SPOT", "on-demand": "ON_DEMAND", "reservation": "ON_DEMAND",
                  "capacity-block": "CAPACITY_BLOCK"}


def provisioner_for(pool: GpuPoolConfig) -> str:
    """"node-group" for reserved capacity and EFA pools, "karpenter" for elastic non-fabric pools."""
    if pool.fabric or pool.capacity in ("reservation", "capacity-block"):
        return "node-group"
    return "karpenter"


@dataclass(frozen=True, kw_only=True)
class Interface:
    network_card_index: int
    device_index: int
    interface_type: str  # "efa" (ENA + EFA, has an IP) or "efa-only" (no IP)


def efa_interfaces(network_cards: int) -> list[Interface]:
    """One EFA interface per network card.

    Card 0 carries the node's primary interface, type "efa" (ENA + EFA) at device index 0: it holds
    the node IP the VPC CNI and kubelet use. Every other card gets an "efa-only" interface at device
    index 1: EFA traffic does not need an IP, so these consume no subnet addresses (32 cards on
    p5 would otherwise cost 31 IPs per node). efa-only needs vpc-cni >= 1.18.4.
    https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html
    """
    if network_cards < 1:
        raise ValueError(f"an instance has at least one network card (got {network_cards})")
    return [Interface(network_card_index=0, device_index=0, interface_type="efa")] + [
        Interface(network_card_index=card, device_index=1, interface_type="efa-only")
        for card in range(1, network_cards)]


def network_cards(instance_type: str) -> int:
    """Maximum network cards from the EC2 API (deploy time); the catalog is the offline check."""
    info = aws.ec2.get_instance_type(instance_type=instance_type)
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


def fabric_for(pool: GpuPoolConfig, cards: int) -> Fabric:
    if not pool.fabric:
        return Fabric(kind="none")
    return Fabric(kind="efa", resources={EFA_RESOURCE: cards}, nccl_env=nccl_env(pool.instance_type))


def node_labels(pool: GpuPoolConfig, spec: InstanceSpec) -> dict[str, str]:
    return {**dict(pool.labels),
            **naming.pool_node_labels(pool.name, pool.capacity, "efa" if pool.fabric else "none", spec.gpu_type)}


def nodeadm_user_data(*, cluster_name: str, endpoint: str, ca_data: str, service_cidr: str,
                      labels: Mapping[str, str], taints: Sequence[Mapping[str, str]]) -> str:
    """MIME multipart user data with an AL2023 nodeadm NodeConfig (pure).

    RAID0s every instance-store NVMe disk and mounts the array at /mnt/k8s-disks/0
    (`instance.localStorage.strategy: RAID0`), and registers the node with its pool labels and taints.
    https://awslabs.github.io/amazon-eks-ami/nodeadm/doc/api/
    """
    label_arg = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    taint_arg = ",".join(f"{t['key']}={t['value']}:{t['effect']}" for t in taints)
    flags = [f"--node-labels={label_arg}"]
    if taint_arg:
        flags.append(f"--register-with-taints={taint_arg}")
    node_config = {
        "apiVersion": "node.eks.aws/v1alpha1",
        "kind": "NodeConfig",
        "spec": {
            "cluster": {"name": cluster_name, "apiServerEndpoint": endpoint, "certificateAuthority": ca_data,
                        "cidr": service_cidr},
            "instance": {"localStorage": {"strategy": "RAID0"}},
            "kubelet": {"flags": flags},
        },
    }
    body = yaml.safe_dump(node_config, sort_keys=False)
    return (f'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="{MIME_BOUNDARY}"\n\n'
            f"--{MIME_BOUNDARY}\nContent-Type: application/node.eks.aws\n\n{body}\n--{MIME_BOUNDARY}--\n")


def efa_security_group_rules() -> list[dict]:
    """EFA requires all traffic to and from the group itself (self-referencing ingress and egress)."""
    return [{"direction": d, "ip_protocol": "-1", "self": True} for d in ("ingress", "egress")]


@dataclass(frozen=True, kw_only=True)
class PoolInput:
    pool: GpuPoolConfig  # the pool's settings
    spec: InstanceSpec  # catalog entry for the instance type


@dataclass(frozen=True, kw_only=True)
class GpuNodeGroupsArgs:
    cluster_name: pulumi.Input[str]  # EKS cluster
    endpoint: pulumi.Input[str]  # API server URL for nodeadm
    ca_data: pulumi.Input[str]  # cluster CA for nodeadm
    service_cidr: str  # Kubernetes service range for nodeadm
    kubernetes_version: str  # selects the NVIDIA AMI SSM parameter
    vpc_id: pulumi.Input[str]  # for the EFA security group
    subnets: Mapping[str, pulumi.Input[str]]  # zone -> private subnet id
    node_security_group_id: pulumi.Input[str]  # the EKS cluster security group
    node_role_arn: pulumi.Input[str]  # managed node group role
    ebs_key_arn: pulumi.Input[str]  # root volume encryption
    pools: Sequence[PoolInput]  # pools with provisioner "node-group"
    tags: Mapping[str, str]  # common tags


def nvidia_ami_parameter(kubernetes_version: str) -> str:
    return f"/aws/service/eks/optimized-ami/{kubernetes_version}/amazon-linux-2023/x86_64/nvidia/recommended/image_id"


class GpuNodeGroups(pulumi.ComponentResource):
    def __init__(self, name: str, args: GpuNodeGroupsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:GpuNodeGroups", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        self.node_groups: list[aws.eks.NodeGroup] = []
        self.fabrics: dict[str, Fabric] = {}
        self.efa_security_group = None
        if not args.pools:
            self.register_outputs({"node_groups": []})
            return
        ami = aws.ssm.get_parameter(name=nvidia_ami_parameter(args.kubernetes_version)).value
        if any(p.pool.fabric for p in args.pools):
            sg = aws.ec2.SecurityGroup(f"{name}-efa", vpc_id=args.vpc_id, description="EFA: all traffic within the group",
                                       tags={**tags, "Name": f"{name}-efa"}, opts=child)
            for rule in efa_security_group_rules():
                cls = aws.vpc.SecurityGroupIngressRule if rule["direction"] == "ingress" else \
                    aws.vpc.SecurityGroupEgressRule
                cls(f"{name}-efa-self-{rule['direction']}", security_group_id=sg.id, ip_protocol=rule["ip_protocol"],
                    referenced_security_group_id=sg.id, description="EFA peers", tags=tags, opts=child)
            self.efa_security_group = sg

        for item in args.pools:
            pool, spec = item.pool, item.spec
            cards = network_cards(pool.instance_type) if pool.fabric else 1
            self.fabrics[pool.name] = fabric_for(pool, cards)
            labels = node_labels(pool, spec)
            user_data = pulumi.Output.all(args.cluster_name, args.endpoint, args.ca_data).apply(
                lambda a, labels=labels: nodeadm_user_data(
                    cluster_name=a[0], endpoint=a[1], ca_data=a[2], service_cidr=args.service_cidr,
                    labels=labels, taints=[naming.GPU_TAINT]))
            groups = [args.node_security_group_id]
            if pool.fabric:
                groups.append(self.efa_security_group.id)
                layout = efa_interfaces(cards)
            else:
                layout = [Interface(network_card_index=0, device_index=0, interface_type="interface")]
            interfaces = [aws.ec2.LaunchTemplateNetworkInterfaceArgs(
                network_card_index=i.network_card_index, device_index=i.device_index,
                interface_type=i.interface_type if i.interface_type != "interface" else None,
                associate_public_ip_address="false", delete_on_termination="true", security_groups=groups)
                for i in layout]

            placement = None
            # Cluster placement group: fabric pools in one AZ on spot / on-demand capacity. Reserved
            # capacity (ODCR, capacity block) is placed by the reservation itself.
            if pool.fabric and pool.placement_group and pool.capacity in ("spot", "on-demand"):
                pg = aws.ec2.PlacementGroup(f"{name}-{pool.name}", strategy="cluster", tags=tags, opts=child)
                placement = aws.ec2.LaunchTemplatePlacementArgs(group_name=pg.name, availability_zone=pool.zone)
            market = reservation = None
            if pool.capacity == "capacity-block":
                market = aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(market_type="capacity-block")
            if pool.capacity in ("reservation", "capacity-block"):
                reservation = aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
                    capacity_reservation_target=aws.ec2.
                    LaunchTemplateCapacityReservationSpecificationCapacityReservationTargetArgs(
                        capacity_reservation_id=pool.reservation_id))

            lt = aws.ec2.LaunchTemplate(
                f"{name}-{pool.name}", description=f"GPU pool {pool.name} ({pool.instance_type})",
                image_id=ami, instance_type=pool.instance_type,
                user_data=user_data.apply(lambda u: base64.b64encode(u.encode()).decode()),
                # Hop limit 1: pods use Pod Identity, so they never need the node's IMDS credentials.
                metadata_options=metadata_options(1),
                block_device_mappings=[root_volume(args.ebs_key_arn, GPU_ROOT_GB)],
                network_interfaces=interfaces, placement=placement, instance_market_options=market,
                capacity_reservation_specification=reservation,
                tag_specifications=[aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=r, tags=tags)
                                    for r in ("instance", "volume", "network-interface")],
                tags=tags, opts=child)
            zones = [pool.zone] if pool.zone else list(args.subnets)
            self.node_groups.append(aws.eks.NodeGroup(
                f"{name}-{pool.name}", cluster_name=args.cluster_name, node_group_name=pool.name,
                node_role_arn=args.node_role_arn, subnet_ids=[args.subnets[z] for z in zones],
                capacity_type=CAPACITY_TYPES[pool.capacity],
                scaling_config=aws.eks.NodeGroupScalingConfigArgs(min_size=pool.min_nodes, max_size=pool.max_nodes,
                                                                  desired_size=pool.min_nodes),
                launch_template=aws.eks.NodeGroupLaunchTemplateArgs(id=lt.id, version=lt.latest_version.apply(str)),
                labels=labels, taints=[aws.eks.NodeGroupTaintArgs(key=naming.GPU_TAINT["key"],
                                                                  value=naming.GPU_TAINT["value"],
                                                                  effect="NO_SCHEDULE")],
                update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
                tags=tags, opts=child))
        self.register_outputs({"node_groups": [g.id for g in self.node_groups]})
