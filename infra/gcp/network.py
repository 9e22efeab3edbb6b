"""VPC, private subnet, Cloud NAT, firewall, private Google APIs and the GPU fabric VPCs.

Usage (inside the Pulumi program; `build_platform` does this):
    net = Network("network", NetworkArgs(stack=cfg.stack, project=..., region=..., vpc_cidr=...,
                  pod_cidr=..., service_cidr=..., master_cidr=..., flow_logs=True,
                  nat_logs=nat_log_filter(is_prod), fabric=fabric_sets(cfg), labels=tags), opts)
    net.network.name, net.subnet.name, net.fabric_networks[(set_key, suffix)]

The pure planners `fabric_sets(cfg)` and `pool_fabric_key(pool)` decide which fabric VPCs and
subnets exist; tests call them without mocks.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpu_train.spec import naming
from gpu_train.spec.catalog.gcp import machine_spec
from gpu_train.spec.settings import GpuPoolSettings, StackSettings

# Google's load-balancer and health-check probers
# (https://cloud.google.com/load-balancing/docs/health-check-concepts#ip-ranges).
HEALTH_CHECK_RANGES = ("35.191.0.0/16", "130.211.0.0/22")
# private.googleapis.com: Google APIs over Private Google Access on routable-only-inside-Google
# addresses (https://cloud.google.com/vpc/docs/configure-private-google-access#domain-options).
PRIVATE_GOOGLE_APIS = "199.36.153.8/30"
PRIVATE_GOOGLE_APIS_IPS = ("199.36.153.8", "199.36.153.9", "199.36.153.10", "199.36.153.11")
# Domains answered by the private DNS zones, so pods and nodes reach GCS, Artifact Registry and
# the other Google APIs through PRIVATE_GOOGLE_APIS only.
PRIVATE_API_DOMAINS = ("googleapis.com.", "pkg.dev.", "gcr.io.")
POD_RANGE = "pods"
SERVICE_RANGE = "services"


# --------------------------------------------------------------------------------------------
# Pure planning
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# GPU fabric networks per machine type.
# --------------------------------------------------------------------------------------------

# GPU NICs run with jumbo frames. The GPUDirect-TCPX/TCPXO guide creates its gVNIC VPCs with MTU
# 8244 (https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx#create-vpcs-subnets);
# A3 Ultra and A4 use 8896 on both their gVNIC and their RoCE VPC, the RDMA profile's default and
# the value Google recommends for RDMA networks
# (https://cloud.google.com/vpc/docs/rdma-network-profiles#specifications,
# https://cloud.google.com/ai-hypercomputer/docs/create/gke-ai-hypercompute-custom).
GPUDIRECT_MTU = 8244
RDMA_MTU = 8896
FABRIC_MTU = {"tcpx": GPUDIRECT_MTU, "tcpxo": GPUDIRECT_MTU, "rdma": RDMA_MTU}
# The guides number fabric subnets 192.168.<N>.0/24; each fabric subnet is one /24 from this block.
FABRIC_BLOCK = "192.168.0.0/16"


@dataclass(frozen=True, kw_only=True)
class FabricVpc:
    """One extra VPC that GPU nodes of a fabric machine type attach to."""

    suffix: str  # name part: "gvnic-1".."gvnic-8" or "rdma"
    rdma: bool  # RoCE VPC (network profile <zone>-vpc-roce) rather than a gVNIC one
    subnets: int  # subnets in this VPC; each subnet is one NIC on the node
    mtu: int  # FABRIC_MTU of the machine's fabric kind


def fabric_vpcs(machine_type: str) -> tuple[FabricVpc, ...]:
    """The extra VPCs a machine type's GPU NICs need, in NIC order (eth1, eth2, ...).

    A3 High (TCPX) has 4 and A3 Mega (TCPXO) 8 GPU NICs, each on its own gVNIC VPC with one
    subnet. A3 Ultra and A4 have one more gVNIC NIC (eth1) plus 8 RDMA NICs, which all sit on a
    single RoCE VPC with one subnet per NIC
    (https://cloud.google.com/ai-hypercomputer/docs/create/gke-ai-hypercompute-custom).
    """
    spec = machine_spec(machine_type)
    if spec.fabric == "none":
        return ()
    mtu = FABRIC_MTU[spec.fabric]
    gvnic = tuple(FabricVpc(suffix=f"gvnic-{i + 1}", rdma=False, subnets=1, mtu=mtu)
                  for i in range(spec.extra_gvnic_networks))
    if spec.rdma_nics:
        return (*gvnic, FabricVpc(suffix="rdma", rdma=True, subnets=spec.rdma_nics, mtu=mtu))
    return gvnic


@dataclass(frozen=True, kw_only=True)
class FabricSubnetPlan:
    name: str  # GCE subnetwork name
    cidr: str
    k8s_network: str  # name of the Kubernetes Network object for this NIC


@dataclass(frozen=True, kw_only=True)
class FabricVpcPlan:
    suffix: str  # "gvnic-1" .. or "rdma"
    name: str  # GCE network name
    mtu: int
    rdma: bool
    zone: str  # RoCE network profiles are zonal; "" for gVNIC VPCs
    subnets: tuple[FabricSubnetPlan, ...]


@dataclass(frozen=True, kw_only=True)
class FabricSetPlan:
    """The fabric VPCs that pools of one fabric kind (and, for RDMA, one zone) share."""

    key: str  # "tcpx", "tcpxo" or "rdma-<zone>"
    kind: str  # tcpx | tcpxo | rdma
    vpcs: tuple[FabricVpcPlan, ...]

    def nics(self) -> tuple[tuple[FabricVpcPlan, FabricSubnetPlan], ...]:
        """Every additional NIC in node order (eth1, eth2, ...)."""
        return tuple((vpc, sub) for vpc in self.vpcs for sub in vpc.subnets)


def pool_fabric_key(pool: GpuPoolSettings) -> str | None:
    """Which fabric set a pool attaches to; None for pools without a fabric."""
    if not pool.fabric:
        return None
    kind = machine_spec(pool.instance_type).fabric
    if kind == "none":
        return None
    return f"rdma-{pool.zone}" if kind == "rdma" else kind


def fabric_sets(cfg: StackSettings) -> dict[str, FabricSetPlan]:
    """Plan every fabric VPC and subnet of the stack, with disjoint /24s from FABRIC_BLOCK.

    Pools of the same fabric kind share one set of VPCs (A3 Ultra and A4 share the RoCE layout);
    each /24 that overlaps the node, pod, service or control-plane ranges is skipped.
    """
    taken = [ipaddress.IPv4Network(c) for c in (cfg.network.vpc_cidr, cfg.network.pod_cidr,
                                                cfg.network.service_cidr, cfg.cluster.master_cidr)]
    free = (n for n in ipaddress.IPv4Network(FABRIC_BLOCK).subnets(new_prefix=24)
            if not any(n.overlaps(t) for t in taken))
    layouts: dict[str, tuple[str, str]] = {}
    for pool in cfg.gpu_pools:
        key = pool_fabric_key(pool)
        if key is not None:
            layouts.setdefault(key, (machine_spec(pool.instance_type).fabric, pool.instance_type))
    sets: dict[str, FabricSetPlan] = {}
    for key in sorted(layouts):
        kind, machine_type = layouts[key]
        zone = key[len("rdma-"):] if kind == "rdma" else ""
        vpcs = []
        for vpc in fabric_vpcs(machine_type):
            name = naming.resource_name(cfg.stack, key, vpc.suffix)
            subnets = []
            for j in range(vpc.subnets):
                try:
                    cidr = str(next(free))
                except StopIteration:
                    raise ValueError(f"{FABRIC_BLOCK} has no free /24 left for fabric subnet {name} "
                                     f"(gpu-train:network ranges overlap it)") from None
                sub_suffix = f"{vpc.suffix}-{j}" if vpc.rdma else vpc.suffix
                subnets.append(FabricSubnetPlan(name=naming.resource_name(cfg.stack, key, sub_suffix, "sub"),
                                                cidr=cidr, k8s_network=f"{key}-{sub_suffix}"))
            vpcs.append(FabricVpcPlan(suffix=vpc.suffix, name=name, mtu=vpc.mtu, rdma=vpc.rdma,
                                      zone=zone if vpc.rdma else "", subnets=tuple(subnets)))
        sets[key] = FabricSetPlan(key=key, kind=kind, vpcs=tuple(vpcs))
    return sets


# Private Service Access (Cloud SQL's private IP): one /20 allocated to Google's producer VPC, the
# size Google suggests so later services fit too (Cloud SQL needs at least a /24;
# https://cloud.google.com/vpc/docs/configure-private-services-access#allocating-range).
PSA_PREFIX = 20
PSA_BLOCK = "10.0.0.0/8"


def psa_range(cfg: StackSettings) -> str:
    """The Private Service Access range: the highest /20 of 10.0.0.0/8 that overlaps nothing of the stack.

    Searching from the top of 10/8 keeps clear of the low 10.x ranges networks usually start at; every
    range of the stack (nodes, pods, services, control plane, fabric block) is skipped.
    """
    taken = [ipaddress.IPv4Network(c) for c in (cfg.network.vpc_cidr, cfg.network.pod_cidr,
                                                cfg.network.service_cidr, cfg.cluster.master_cidr, FABRIC_BLOCK)]
    for net in reversed(list(ipaddress.IPv4Network(PSA_BLOCK).subnets(new_prefix=PSA_PREFIX))):
        if not any(net.overlaps(t) for t in taken):
            return str(net)
    raise ValueError(f"no free /{PSA_PREFIX} in {PSA_BLOCK} for Private Service Access "
                     "(gpu-train:network ranges cover it all)")


def roce_network_profile(project: str, zone: str) -> str:
    """The zone's RoCE network profile an RDMA VPC must be created with."""
    return f"projects/{project}/global/networkProfiles/{zone}-vpc-roce"


def nat_log_filter(is_prod: bool) -> str:
    """Cloud NAT logging: every translation in prod (audit), errors only elsewhere (cost)."""
    return "ALL" if is_prod else "ERRORS_ONLY"


# --------------------------------------------------------------------------------------------
# Component
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NetworkArgs:
    stack: str  # the Pulumi stack name (names every network resource)
    project: str  # GCP project id
    region: str  # region of the subnets, router and NAT
    vpc_cidr: str  # primary range of the node subnet
    pod_cidr: str  # the node subnet's secondary range for pods
    service_cidr: str  # the node subnet's secondary range for Services
    master_cidr: str  # the private control-plane range (allowed in by the internal firewall rule)
    flow_logs: bool  # flow logs on the node subnet
    nat_logs: str  # Cloud NAT log filter (nat_log_filter)
    fabric: Mapping[str, FabricSetPlan]  # the fabric VPCs and subnets to create (fabric_sets)
    labels: dict[str, str]  # common labels (only the DNS zones take labels here)


class Network(pulumi.ComponentResource):
    """The cluster VPC and every fabric VPC the stack's GPU pools attach to."""

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:Network", name, None, opts)
        self._vpc(name, args)
        self._nat(name, args)
        self._firewalls(name, args)
        self._private_google_access(name, args)
        self._fabric(name, args)
        self.register_outputs({"network": self.network.name, "subnet": self.subnet.name,
                               "fabric_networks": [n.name for n in self.fabric_networks.values()]})

    def _vpc(self, name: str, args: NetworkArgs) -> None:
        """The VPC and the nodes' subnet, with the pod and service ranges."""
        stack, project, region = args.stack, args.project, args.region
        child = pulumi.ResourceOptions(parent=self)
        self.network = gcp.compute.Network(
            f"{name}-vpc", name=naming.resource_name(stack, "vpc"), project=project,
            auto_create_subnetworks=False, routing_mode="REGIONAL", opts=child)
        self.subnet = gcp.compute.Subnetwork(
            f"{name}-nodes", name=naming.resource_name(stack, "nodes"), project=project, region=region,
            network=self.network.id, ip_cidr_range=args.vpc_cidr,
            secondary_ip_ranges=[
                gcp.compute.SubnetworkSecondaryIpRangeArgs(range_name=POD_RANGE,
                                                           ip_cidr_range=args.pod_cidr),
                gcp.compute.SubnetworkSecondaryIpRangeArgs(range_name=SERVICE_RANGE,
                                                           ip_cidr_range=args.service_cidr),
            ],
            private_ip_google_access=True,
            log_config=gcp.compute.SubnetworkLogConfigArgs(
                aggregation_interval="INTERVAL_5_SEC", flow_sampling=0.5,
                metadata="INCLUDE_ALL_METADATA") if args.flow_logs else None,
            opts=child)

    def _nat(self, name: str, args: NetworkArgs) -> None:
        """Cloud NAT, the nodes' only egress to the internet."""
        stack, project, region = args.stack, args.project, args.region
        child = pulumi.ResourceOptions(parent=self)
        # Nodes have no external addresses; Cloud NAT gives them (and pods) egress for image pulls.
        self.router = gcp.compute.Router(
            f"{name}-router", name=naming.resource_name(stack, "router"), project=project, region=region,
            network=self.network.id, opts=child)
        self.nat = gcp.compute.RouterNat(
            f"{name}-nat", name=naming.resource_name(stack, "nat"), project=project, region=region,
            router=self.router.name, nat_ip_allocate_option="AUTO_ONLY",
            source_subnetwork_ip_ranges_to_nat="LIST_OF_SUBNETWORKS",
            subnetworks=[gcp.compute.RouterNatSubnetworkArgs(
                name=self.subnet.id, source_ip_ranges_to_nats=["ALL_IP_RANGES"])],
            enable_endpoint_independent_mapping=False,
            log_config=gcp.compute.RouterNatLogConfigArgs(enable=True, filter=args.nat_logs),
            opts=child)

    def _firewalls(self, name: str, args: NetworkArgs) -> None:
        """Ingress from inside the VPC and from Google's health checkers."""
        stack, project = args.stack, args.project
        child = pulumi.ResourceOptions(parent=self)
        internal = [args.vpc_cidr, args.pod_cidr, args.service_cidr, args.master_cidr]
        self.firewalls = [
            gcp.compute.Firewall(
                f"{name}-allow-internal", name=naming.resource_name(stack, "allow-internal"),
                project=project, network=self.network.id, direction="INGRESS", priority=1000,
                source_ranges=internal,
                allows=[gcp.compute.FirewallAllowArgs(protocol="tcp"),
                        gcp.compute.FirewallAllowArgs(protocol="udp"),
                        gcp.compute.FirewallAllowArgs(protocol="icmp")],
                log_config=gcp.compute.FirewallLogConfigArgs(metadata="INCLUDE_ALL_METADATA"),
                opts=child),
            gcp.compute.Firewall(
                f"{name}-allow-health-checks", name=naming.resource_name(stack, "allow-health-checks"),
                project=project, network=self.network.id, direction="INGRESS", priority=1000,
                source_ranges=list(HEALTH_CHECK_RANGES),
                allows=[gcp.compute.FirewallAllowArgs(protocol="tcp")],
                log_config=gcp.compute.FirewallLogConfigArgs(metadata="INCLUDE_ALL_METADATA"),
                opts=child),
        ]

    def _private_google_access(self, name: str, args: NetworkArgs) -> None:
        """The route to private.googleapis.com and the private zones that resolve to it."""
        stack, project = args.stack, args.project
        child = pulumi.ResourceOptions(parent=self)
        # Private Google Access through private.googleapis.com: a route to the VIP and private zones
        # that answer *.googleapis.com / *.pkg.dev / *.gcr.io with it, so egress to Google APIs
        # (GCS above all) stays on 199.36.153.8/30 and NetworkPolicies can allow exactly that.
        self.private_api_route = gcp.compute.Route(
            f"{name}-private-apis", name=naming.resource_name(stack, "private-apis"), project=project,
            network=self.network.id, dest_range=PRIVATE_GOOGLE_APIS,
            next_hop_gateway="default-internet-gateway", priority=100, opts=child)
        self.dns_zones = []
        for domain in PRIVATE_API_DOMAINS:
            slug = domain.rstrip(".").replace(".", "-")
            zone = gcp.dns.ManagedZone(
                f"{name}-{slug}", name=naming.resource_name(stack, slug), project=project,
                dns_name=domain, visibility="private", labels=args.labels,
                description=f"Private Google Access for {domain}",
                private_visibility_config=gcp.dns.ManagedZonePrivateVisibilityConfigArgs(
                    networks=[gcp.dns.ManagedZonePrivateVisibilityConfigNetworkArgs(
                        network_url=self.network.id)]),
                opts=child)
            gcp.dns.RecordSet(f"{name}-{slug}-a", project=project, managed_zone=zone.name,
                              name=f"private.{domain}" if domain == "googleapis.com." else domain,
                              type="A", ttl=300, rrdatas=list(PRIVATE_GOOGLE_APIS_IPS), opts=child)
            gcp.dns.RecordSet(f"{name}-{slug}-cname", project=project, managed_zone=zone.name,
                              name=f"*.{domain}", type="CNAME", ttl=300,
                              rrdatas=[f"private.{domain}" if domain == "googleapis.com." else domain],
                              opts=child)
            self.dns_zones.append(zone)

    def _fabric(self, name: str, args: NetworkArgs) -> None:
        """The GPU fabric's VPCs, subnets and firewalls."""
        stack, project, region = args.stack, args.project, args.region
        child = pulumi.ResourceOptions(parent=self)
        # GPU fabric: one VPC per GPU NIC (gVNIC) or one RoCE VPC for the RDMA NICs.
        self.fabric = dict(args.fabric)
        self.fabric_networks: dict[tuple[str, str], gcp.compute.Network] = {}
        self.fabric_subnets: dict[str, gcp.compute.Subnetwork] = {}
        self.fabric_firewalls: list[gcp.compute.Firewall] = []
        for key, fset in self.fabric.items():
            for vpc in fset.vpcs:
                net = gcp.compute.Network(
                    f"{name}-{key}-{vpc.suffix}", name=vpc.name, project=project,
                    auto_create_subnetworks=False, mtu=vpc.mtu, routing_mode="REGIONAL",
                    network_profile=roce_network_profile(project, vpc.zone) if vpc.rdma else None,
                    opts=child)
                self.fabric_networks[(key, vpc.suffix)] = net
                for sub in vpc.subnets:
                    self.fabric_subnets[sub.name] = gcp.compute.Subnetwork(
                        f"{name}-{sub.name}", name=sub.name, project=project, region=region,
                        network=net.id, ip_cidr_range=sub.cidr, opts=child)
                if not vpc.rdma:
                    # Fabric traffic is node-to-node only: allow it from the fabric subnets themselves.
                    self.fabric_firewalls.append(gcp.compute.Firewall(
                        f"{name}-{key}-{vpc.suffix}-internal",
                        name=naming.resource_name(stack, key, vpc.suffix, "internal"), project=project,
                        network=net.id, direction="INGRESS", priority=1000,
                        source_ranges=[s.cidr for s in vpc.subnets],
                        allows=[gcp.compute.FirewallAllowArgs(protocol="tcp"),
                                gcp.compute.FirewallAllowArgs(protocol="udp"),
                                gcp.compute.FirewallAllowArgs(protocol="icmp")],
                        opts=child))
                # A RoCE VPC rejects VPC firewall rules (only regional network firewall policies of
                # type RDMA_ROCE_POLICY apply to it) and implicitly allows ingress and egress, so it
                # gets none: https://cloud.google.com/firewall/docs/firewall-for-roce. Only GPU NICs
                # of nodes in the profile's zone can attach to it at all.
