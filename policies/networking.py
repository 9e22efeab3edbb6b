"""Networking rules: no public node IPs, no world-open ingress, private control planes.

Usage: `from policies import networking; list(networking.no_public_node_ips(res, ctx))` yields one
detail string per problem; `policies.registry.RULES` binds each function to its rule id.

References: EKS endpoint access defaults to public from 0.0.0.0/0
(https://docs.aws.amazon.com/eks/latest/userguide/cluster-endpoint.html); GKE private nodes and
authorized networks (https://cloud.google.com/kubernetes-engine/docs/how-to/latest/network-isolation).
"""

from __future__ import annotations

from collections.abc import Iterator

from policies.core import Context, Resource, dig, falsy, items, open_cidrs, truthy

LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
SUBNET = "aws:ec2/subnet:Subnet"
INSTANCE = "aws:ec2/instance:Instance"
EC2_NODE_CLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SECURITY_GROUP_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
FIREWALL = "gcp:compute/firewall:Firewall"
EKS_CLUSTER = "aws:eks/cluster:Cluster"
GKE_CLUSTER = "gcp:container/cluster:Cluster"
GKE_NODE_POOL = "gcp:container/nodePool:NodePool"

# Subnets tagged for internet-facing load balancers are the public tier; nodes never live there.
# (https://docs.aws.amazon.com/eks/latest/userguide/network-load-balancing.html)
PUBLIC_LB_SUBNET_TAG = "kubernetes.io/role/elb"


def no_public_node_ips(res: Resource, ctx: Context) -> Iterator[str]:
    """Nodes get no public IP: launch templates, node subnets, instances, Karpenter, GKE node pools.

    The GKE cluster-wide private-nodes setting is `gke_private_cluster`'s.
    """
    if res.type == LAUNCH_TEMPLATE:
        for i, nic in enumerate(items(res.get("networkInterfaces"))):
            if truthy(dig(nic, "associatePublicIpAddress")):
                yield f"networkInterfaces[{i}].associatePublicIpAddress is true, so every node gets a public IP."
    elif res.type == SUBNET:
        if truthy(res.get("mapPublicIpOnLaunch")) and PUBLIC_LB_SUBNET_TAG not in (res.get("tags") or {}):
            yield ("mapPublicIpOnLaunch is true on a node subnet (not tagged "
                   f"{PUBLIC_LB_SUBNET_TAG}), so instances launched there get public IPs.")
    elif res.type == INSTANCE:
        if truthy(res.get("associatePublicIpAddress")):
            yield "associatePublicIpAddress is true."
    elif res.type == EC2_NODE_CLASS:
        if truthy(res.get("spec", "associatePublicIPAddress")):
            yield "spec.associatePublicIPAddress is true, so Karpenter nodes get public IPs."
    elif res.type == GKE_NODE_POOL and falsy(res.get("networkConfig", "enablePrivateNodes")):
        yield "networkConfig.enablePrivateNodes is false, overriding the cluster's private nodes."


def no_open_ingress(res: Resource, ctx: Context) -> Iterator[str]:
    """No security group rule or firewall admits traffic from 0.0.0.0/0 or ::/0."""
    if res.type == SECURITY_GROUP:
        for i, rule in enumerate(items(res.get("ingress"))):
            world = open_cidrs(dig(rule, "cidrBlocks")) + open_cidrs(dig(rule, "ipv6CidrBlocks"))
            if world:
                yield f"ingress[{i}] admits {', '.join(world)} on ports {_ports(rule)}."
    elif res.type == SECURITY_GROUP_RULE:
        if res.get("type") == "ingress":
            world = open_cidrs(res.get("cidrBlocks")) + open_cidrs(res.get("ipv6CidrBlocks"))
            if world:
                yield f"ingress rule admits {', '.join(world)} on ports {_ports(res.props)}."
    elif res.type == INGRESS_RULE:
        world = open_cidrs([res.get("cidrIpv4"), res.get("cidrIpv6")])
        if world:
            yield f"ingress rule admits {', '.join(world)} on ports {_ports(res.props)}."
    elif res.type == FIREWALL:
        direction = str(res.get("direction", default="INGRESS")).upper()
        if direction == "INGRESS" and not truthy(res.get("disabled")) and items(res.get("allows")):
            world = open_cidrs(res.get("sourceRanges"))
            if world:
                yield f"INGRESS allow rule has sourceRanges {', '.join(world)}."


def _ports(rule) -> str:
    lo, hi = dig(rule, "fromPort"), dig(rule, "toPort")
    return str(lo) if lo == hi else f"{lo}-{hi}"


def eks_endpoint_restricted(res: Resource, ctx: Context) -> Iterator[str]:
    """An EKS API endpoint is private, or public only to listed CIDRs (never 0.0.0.0/0)."""
    if res.type != EKS_CLUSTER:
        return
    # EKS defaults endpointPublicAccess to true and publicAccessCidrs to 0.0.0.0/0.
    public = res.get("vpcConfig", "endpointPublicAccess")
    if falsy(public):
        return
    cidrs = items(res.get("vpcConfig", "publicAccessCidrs"))
    if not cidrs:
        yield ("the API endpoint is public (vpcConfig.endpointPublicAccess is not false) and "
               "vpcConfig.publicAccessCidrs is empty, which EKS treats as 0.0.0.0/0.")
    elif open_cidrs(cidrs):
        yield f"vpcConfig.publicAccessCidrs includes {', '.join(open_cidrs(cidrs))}."
    if not truthy(res.get("vpcConfig", "endpointPrivateAccess")):
        yield "vpcConfig.endpointPrivateAccess is not true, so nodes reach the API over the internet."


def gke_private_cluster(res: Resource, ctx: Context) -> Iterator[str]:
    """GKE: private nodes and a control plane reachable only from authorized networks."""
    if res.type != GKE_CLUSTER:
        return
    if not truthy(res.get("privateClusterConfig", "enablePrivateNodes")):
        yield "privateClusterConfig.enablePrivateNodes is not true."
    man = res.get("masterAuthorizedNetworksConfig")
    private_endpoint = truthy(res.get("privateClusterConfig", "enablePrivateEndpoint"))
    if man is None:
        if not private_endpoint:
            yield ("masterAuthorizedNetworksConfig is not set and the endpoint is public, so any "
                   "address can reach the control plane.")
        return
    blocks = [dig(b, "cidrBlock") for b in items(dig(man, "cidrBlocks"))]
    if open_cidrs(blocks):
        yield f"masterAuthorizedNetworksConfig.cidrBlocks includes {', '.join(open_cidrs(blocks))}."
    if truthy(dig(man, "gcpPublicCidrsAccessEnabled")):
        yield "masterAuthorizedNetworksConfig.gcpPublicCidrsAccessEnabled opens the endpoint to all of Google Cloud."
