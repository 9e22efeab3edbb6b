"""Networking rules: no public node IPs, no world-open ingress, private control planes.

Usage: `from policies import networking; list(networking.no_open_ingress(resources, ctx))` yields
`(resource, detail)` pairs; `policies.registry.RULES` binds each function to its rule id.

Every list of address ranges is normalised with `policies.cidrs.internet_coverage`: a set that covers
every public IPv4 or IPv6 address counts as open however it is written (`0.0.0.0/0`, `0::/0`,
`0.0.0.0/1` + `128.0.0.0/1`, many small ranges, split over several rules of one security group).

References: EKS endpoint access defaults to public from 0.0.0.0/0
(https://docs.aws.amazon.com/eks/latest/userguide/cluster-endpoint.html); GKE private nodes and
authorized networks (https://cloud.google.com/kubernetes-engine/docs/how-to/latest/network-isolation);
subnet tags for load balancers (https://docs.aws.amazon.com/eks/latest/userguide/network-load-balancing.html);
Karpenter subnet selector terms (https://karpenter.sh/docs/concepts/nodeclasses/#specsubnetselectorterms).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from policies.cidrs import internet_coverage
from policies.core import Context, Resource, as_int, dig, falsy, items, truthy

LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
SUBNET = "aws:ec2/subnet:Subnet"
INSTANCE = "aws:ec2/instance:Instance"
AUTOSCALING_GROUP = "aws:autoscaling/group:Group"
EC2_NODE_CLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
ENI_CONFIG = "kubernetes:crd.k8s.amazonaws.com/v1alpha1:ENIConfig"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SECURITY_GROUP_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
FIREWALL = "gcp:compute/firewall:Firewall"
EKS_CLUSTER = "aws:eks/cluster:Cluster"
EKS_NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
GKE_CLUSTER = "gcp:container/cluster:Cluster"
GKE_NODE_POOL = "gcp:container/nodePool:NodePool"

# Subnets tagged for internet-facing load balancers are the public tier; nodes never live there.
PUBLIC_LB_SUBNET_TAG = "kubernetes.io/role/elb"
INTERNAL_LB_SUBNET_TAG = "kubernetes.io/role/internal-elb"
ALL_PORTS = (0, 65535)
_PROTOCOLS = {"-1": "all", "all": "all", "6": "tcp", "17": "udp", "1": "icmp", "58": "icmpv6"}


# --------------------------------------------------------------------------------------------
# Node public IPs (launch templates, instances, Karpenter, GKE node pools, node subnets)
# --------------------------------------------------------------------------------------------


def _node_subnet_refs(resources: Sequence[Resource]) -> tuple[dict[str, str], list[Mapping]]:
    """Subnet references that place nodes or pods ({reference: who}) and Karpenter's tag selectors."""
    refs: dict[str, str] = {}
    selectors: list[Mapping] = []

    def add(values, who: str) -> None:
        for v in values:
            if isinstance(v, str) and v:
                refs.setdefault(v, who)

    for res in resources:
        if res.type == EKS_NODE_GROUP:
            add(items(res.get("subnetIds")), f"node group '{res.name}'")
        elif res.type == EKS_CLUSTER:
            add(items(res.get("vpcConfig", "subnetIds")), f"EKS cluster '{res.name}'")
        elif res.type == INSTANCE:
            add([res.get("subnetId")], f"instance '{res.name}'")
        elif res.type == AUTOSCALING_GROUP:
            add(items(res.get("vpcZoneIdentifiers")), f"autoscaling group '{res.name}'")
        elif res.type == LAUNCH_TEMPLATE:
            add([dig(n, "subnetId") for n in items(res.get("networkInterfaces"))], f"launch template '{res.name}'")
        elif res.type == ENI_CONFIG:
            add([res.get("spec", "subnet")], f"ENIConfig '{res.name}' (pod subnet)")
        elif res.type == EC2_NODE_CLASS:
            for term in items(res.get("spec", "subnetSelectorTerms")):
                if isinstance(dig(term, "tags"), Mapping):
                    selectors.append({"tags": dig(term, "tags"), "who": f"EC2NodeClass '{res.name}'"})
                add([dig(term, "id")], f"EC2NodeClass '{res.name}'")
    return refs, selectors


def _selected(tags: Mapping, selector: Mapping) -> bool:
    """Karpenter's tag selector: every key present, with the value or '*'."""
    want = selector["tags"]
    return bool(want) and all(k in tags and (v == "*" or tags[k] == v) for k, v in want.items())


def node_subnets(resources: Sequence[Resource]) -> dict[str, str]:
    """{subnet urn: why it is a node (or pod, or private-tier) subnet}."""
    refs, selectors = _node_subnet_refs(resources)
    found: dict[str, str] = {}
    for sub in resources:
        if sub.type != SUBNET:
            continue
        tags = sub.get("tags") or {}
        why = next((who for ref, who in refs.items() if sub.referred_by(ref)), None)
        why = why or next((s["who"] for s in selectors if _selected(tags, s)), None)
        if why is None and INTERNAL_LB_SUBNET_TAG in tags:
            why = f"its {INTERNAL_LB_SUBNET_TAG} tag (private tier)"
        if why:
            found[sub.urn] = why
    return found


def _resource_public_ips(res: Resource) -> Iterator[str]:
    if res.type == LAUNCH_TEMPLATE:
        for i, nic in enumerate(items(res.get("networkInterfaces"))):
            if truthy(dig(nic, "associatePublicIpAddress")):
                yield f"networkInterfaces[{i}].associatePublicIpAddress is true, so every node gets a public IP."
    elif res.type == INSTANCE:
        if truthy(res.get("associatePublicIpAddress")):
            yield "associatePublicIpAddress is true."
    elif res.type == EC2_NODE_CLASS:
        if truthy(res.get("spec", "associatePublicIPAddress")):
            yield "spec.associatePublicIPAddress is true, so Karpenter nodes get public IPs."
    elif res.type == GKE_NODE_POOL and falsy(res.get("networkConfig", "enablePrivateNodes")):
        yield "networkConfig.enablePrivateNodes is false, overriding the cluster's private nodes."


def no_public_node_ips(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Nodes get no public IP: launch templates, instances, Karpenter, GKE node pools and node subnets.

    A node subnet is one that node groups, the cluster, instances, ENIConfigs or Karpenter's subnet
    selector place nodes or pods in, or one tagged for internal load balancers. It must not map public
    IPs on launch nor be tagged for internet-facing load balancers. Any other subnet that maps public
    IPs must be the tagged public load-balancer tier. The GKE cluster-wide private-nodes setting is
    `gke_private_cluster`'s.
    """
    nodes = node_subnets(resources)
    for res in resources:
        for detail in _resource_public_ips(res):
            yield res, detail
        if res.type != SUBNET:
            continue
        tags = res.get("tags") or {}
        maps_public = truthy(res.get("mapPublicIpOnLaunch"))
        if res.urn in nodes:
            if maps_public:
                yield res, (f"mapPublicIpOnLaunch is true on a node subnet (used by {nodes[res.urn]}), so "
                            "nodes launched there get public IPs.")
            if PUBLIC_LB_SUBNET_TAG in tags:
                yield res, (f"the node subnet (used by {nodes[res.urn]}) is tagged {PUBLIC_LB_SUBNET_TAG}, so "
                            "internet-facing load balancers are placed among the nodes.")
        elif maps_public and PUBLIC_LB_SUBNET_TAG not in tags:
            yield res, ("mapPublicIpOnLaunch is true on a subnet that is not the public load-balancer tier "
                        f"(not tagged {PUBLIC_LB_SUBNET_TAG}), so instances launched there get public IPs.")


# --------------------------------------------------------------------------------------------
# Ingress from the internet (security groups, security group rules, firewalls)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Ingress:
    """One ingress allowance: who admits it, on which protocol and ports, from which ranges."""

    resource: Resource
    where: str  # e.g. "ingress[0]", "rule", "allows[1]"
    protocol: str  # tcp | udp | icmp | icmpv6 | all | a protocol number
    ports: tuple[int, int]
    cidrs: tuple[str, ...] = field(default_factory=tuple)


def _protocol(value) -> str:
    text = str(value if value is not None else "all").strip().lower()
    return _PROTOCOLS.get(text, text)


def _port_range(protocol: str, lo, hi) -> tuple[int, int]:
    lo, hi = as_int(lo), as_int(hi)
    if protocol == "all" or lo is None or lo < 0:
        return ALL_PORTS
    return lo, hi if hi is not None and hi >= lo else lo


def _gcp_ports(spec: str) -> tuple[int, int] | None:
    lo, _, hi = str(spec).partition("-")
    a, b = as_int(lo), as_int(hi or lo)
    return (a, b) if a is not None and b is not None else None


def _aws_cidrs(rule) -> tuple[str, ...]:
    return tuple(str(c) for c in [*items(dig(rule, "cidrBlocks")), *items(dig(rule, "ipv6CidrBlocks"))])


def ingress_groups(resources: Sequence[Resource]) -> dict[str, list[Ingress]]:
    """Ingress allowances grouped by what they open: a security group, or a firewall target set."""
    groups: dict[str, list[Ingress]] = {}
    sgs = [r for r in resources if r.type == SECURITY_GROUP]

    def sg_key(ref) -> str:
        owner = next((sg for sg in sgs if sg.referred_by(ref)), None)
        return f"sg:{owner.urn if owner else ref}"

    for res in resources:
        if res.type == SECURITY_GROUP:
            for i, rule in enumerate(items(res.get("ingress"))):
                proto = _protocol(dig(rule, "protocol"))
                groups.setdefault(f"sg:{res.urn}", []).append(Ingress(
                    resource=res, where=f"ingress[{i}]", protocol=proto,
                    ports=_port_range(proto, dig(rule, "fromPort"), dig(rule, "toPort")), cidrs=_aws_cidrs(rule)))
        elif res.type == SECURITY_GROUP_RULE and res.get("type") == "ingress":
            proto = _protocol(res.get("protocol"))
            groups.setdefault(sg_key(res.get("securityGroupId")), []).append(Ingress(
                resource=res, where="rule", protocol=proto,
                ports=_port_range(proto, res.get("fromPort"), res.get("toPort")), cidrs=_aws_cidrs(res.props)))
        elif res.type == INGRESS_RULE:
            proto = _protocol(res.get("ipProtocol"))
            cidrs = tuple(str(c) for c in (res.get("cidrIpv4"), res.get("cidrIpv6")) if c)
            groups.setdefault(sg_key(res.get("securityGroupId")), []).append(Ingress(
                resource=res, where="rule", protocol=proto,
                ports=_port_range(proto, res.get("fromPort"), res.get("toPort")), cidrs=cidrs))
        elif res.type == FIREWALL:
            direction = str(res.get("direction", default="INGRESS")).upper()
            if direction != "INGRESS" or truthy(res.get("disabled")):
                continue
            key = "fw:{}:{}:{}".format(res.get("network"), sorted(items(res.get("targetTags"))),
                                        sorted(items(res.get("targetServiceAccounts"))))
            cidrs = tuple(str(c) for c in items(res.get("sourceRanges")))
            for i, allow in enumerate(items(res.get("allows"))):
                proto = _protocol(dig(allow, "protocol"))
                ranges = [_gcp_ports(p) for p in items(dig(allow, "ports"))] or [ALL_PORTS]
                for ports in ranges:
                    groups.setdefault(key, []).append(Ingress(
                        resource=res, where=f"allows[{i}]", protocol=proto, ports=ports or ALL_PORTS, cidrs=cidrs))
    return groups


def _describe(cidrs: list[str]) -> str:
    shown = ", ".join(cidrs[:4])
    return shown + (f" and {len(cidrs) - 4} more" if len(cidrs) > 4 else "")


def no_open_ingress(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """No security group or firewall target admits, on any port, every public IPv4 or IPv6 address.

    The ranges of every allowance that applies to the same protocol and port of the same security
    group (inline rules and separate rule resources) or the same firewall targets are joined first.
    """
    seen: set[tuple[str, str]] = set()
    for group in ingress_groups(resources).values():
        for entry in group:
            port = entry.ports[0]
            joined = [g for g in group
                      if (g.protocol == entry.protocol or g.protocol == "all") and g.ports[0] <= port <= g.ports[1]]
            cidrs = sorted({c for g in joined for c in g.cidrs})
            coverage = internet_coverage(cidrs)
            if not coverage:
                continue
            ports = "all ports" if entry.ports == ALL_PORTS else (
                f"port {port}" if entry.ports[0] == entry.ports[1] else f"ports {entry.ports[0]}-{entry.ports[1]}")
            others = sorted({f"{g.resource.name} {g.where}" for g in joined if g is not entry})
            detail = (f"{entry.where} admits {coverage} on {entry.protocol} {ports} "
                      f"(sources {_describe(cidrs)}" + (f", joined with {', '.join(others)}" if others else "") + ").")
            if (entry.resource.urn, detail) not in seen:
                seen.add((entry.resource.urn, detail))
                yield entry.resource, detail


# --------------------------------------------------------------------------------------------
# Control-plane endpoints
# --------------------------------------------------------------------------------------------


def eks_endpoint_restricted(res: Resource, ctx: Context) -> Iterator[str]:
    """An EKS API endpoint is private, or public only to listed CIDRs that do not add up to the internet."""
    if res.type != EKS_CLUSTER:
        return
    # EKS defaults endpointPublicAccess to true and publicAccessCidrs to 0.0.0.0/0.
    public = res.get("vpcConfig", "endpointPublicAccess")
    if not falsy(public):
        cidrs = [str(c) for c in items(res.get("vpcConfig", "publicAccessCidrs"))]
        coverage = internet_coverage(cidrs)
        if not cidrs:
            yield ("the API endpoint is public (vpcConfig.endpointPublicAccess is not false) and "
                   "vpcConfig.publicAccessCidrs is empty, which EKS treats as 0.0.0.0/0.")
        elif coverage:
            yield f"vpcConfig.publicAccessCidrs ({_describe(cidrs)}) admits {coverage}."
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
    blocks = [str(dig(b, "cidrBlock")) for b in items(dig(man, "cidrBlocks"))]
    coverage = internet_coverage(blocks)
    if coverage:
        yield f"masterAuthorizedNetworksConfig.cidrBlocks ({_describe(blocks)}) admits {coverage}."
    if truthy(dig(man, "gcpPublicCidrsAccessEnabled")):
        yield "masterAuthorizedNetworksConfig.gcpPublicCidrsAccessEnabled opens the endpoint to all of Google Cloud."
