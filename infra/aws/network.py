"""VPC for the EKS cluster: private node subnets, per-AZ pod subnets, NAT, endpoints, flow logs.

Usage:
    plan = plan_subnets("10.10.0.0/16", "100.64.0.0/16", ["us-east-1a", "us-east-1b", "us-east-1c"])
    net = Network("network", NetworkArgs(...))   # net.vpc_id, net.private_subnet_ids, net.pod_subnets, ...

Layout (see `plan_subnets`): the VPC CIDR is cut into one large private /N per AZ for nodes (and
the EKS control-plane ENIs) plus a small public /24-ish per AZ that holds only NAT gateways. The pod
range (`network.podCidr`, e.g. 100.64.0.0/16) is a secondary VPC CIDR split into one subnet per AZ;
the VPC CNI hands pods addresses from these through custom networking (ENIConfig per AZ, created
by `Cluster` in `infra/aws/cluster.py`), so GPU nodes with many pods never exhaust the node range.
"""

from __future__ import annotations

import ipaddress
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.aws.iam import flow_logs_policy, service_trust

# Interface endpoints a cluster with no internet path for AWS APIs needs: image pulls (ecr.*, with
# layers from S3 through the gateway endpoint), credentials (sts, eks-auth for Pod Identity), node
# bootstrap and Karpenter (ec2, eks, autoscaling, sqs), logs, SSM session access and KMS.
# https://docs.aws.amazon.com/eks/latest/userguide/private-clusters.html
INTERFACE_ENDPOINTS = (
    "ecr.api", "ecr.dkr", "sts", "ec2", "logs", "sqs", "eks", "eks-auth", "ssm", "ssmmessages",
    "ec2messages", "elasticloadbalancing", "autoscaling", "kms",
)


@dataclass(frozen=True, kw_only=True)
class ZoneSubnets:
    """The CIDR blocks of one availability zone."""

    zone: str
    private: str  # nodes and control-plane ENIs
    public: str  # NAT gateway only
    pods: str  # VPC CNI custom networking (secondary CIDR)
    database: str  # managed PostgreSQL only (created when the stack asks for a managed database)


def _split(network: ipaddress.IPv4Network, count: int, what: str) -> list[ipaddress.IPv4Network]:
    bits = math.ceil(math.log2(count)) if count > 1 else 0
    if network.prefixlen + bits > 28:
        raise ValueError(f"{what} {network} is too small for {count} zones")
    return list(network.subnets(prefixlen_diff=bits))[:count]


def plan_subnets(vpc_cidr: str, pod_cidr: str, zones: Sequence[str]) -> list[ZoneSubnets]:
    """Split the VPC and pod ranges over `zones` (pure; deterministic; no overlaps).

    The VPC range is halved per power of two of zones; in each zone's share, the first half is the
    private node subnet, a /(share+4) slice at the end is the public NAT subnet, and a small slice
    at the start of the second half (/(share+6), kept between /24 and /28) is the database subnet.
    For a /16 and 3 zones: private /19s (8190 addresses each), public /22s and database /24s. The
    pod range is split evenly.
    """
    if not zones:
        raise ValueError("network plan needs at least one zone")
    if len(set(zones)) != len(zones):
        raise ValueError(f"zones must be distinct (got {list(zones)})")
    vpc = ipaddress.IPv4Network(vpc_cidr, strict=True)
    pods = ipaddress.IPv4Network(pod_cidr, strict=True)
    if vpc.overlaps(pods):
        raise ValueError(f"network.podCidr {pods} overlaps network.vpcCidr {vpc}")
    shares = _split(vpc, len(zones), "network.vpcCidr")
    pod_shares = _split(pods, len(zones), "network.podCidr")
    plan = []
    for zone, share, pod in zip(zones, shares, pod_shares, strict=True):
        private, rest = share.subnets(prefixlen_diff=1)
        public = list(rest.subnets(new_prefix=min(share.prefixlen + 4, 28)))[-1]
        database = next(rest.subnets(new_prefix=min(max(share.prefixlen + 6, 24), 28)))
        plan.append(ZoneSubnets(zone=zone, private=str(private), public=str(public), pods=str(pod),
                                database=str(database)))
    return plan


def nat_zones(zones: Sequence[str], mode: str) -> list[str]:
    """Zones that get a NAT gateway: all of them ("per-zone") or the first ("single")."""
    if mode == "per-zone":
        return list(zones)
    if mode == "single":
        return [zones[0]]
    raise ValueError(f"network.nat must be 'single' or 'per-zone' (got {mode!r})")


@dataclass(frozen=True, kw_only=True)
class NetworkArgs:
    cluster_name: str  # value of the karpenter.sh/discovery tag on node subnets
    region: str  # AWS region (endpoint service names)
    account_id: str  # for the flow-logs trust policy
    zones: Sequence[str]  # availability zones, in order
    vpc_cidr: str  # node range
    pod_cidr: str  # secondary range for pods
    nat: str  # "single" | "per-zone"
    flow_logs: bool  # VPC flow logs to an encrypted log group
    logs_key_arn: pulumi.Input[str]  # KMS key for the flow-log group
    tags: Mapping[str, str]  # common tags
    database_subnets: bool = False  # private, route-less subnets per AZ for a managed database


class Network(pulumi.ComponentResource):
    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        self.plan = plan_subnets(args.vpc_cidr, args.pod_cidr, args.zones)
        vpc = aws.ec2.Vpc(name, cidr_block=args.vpc_cidr, enable_dns_hostnames=True, enable_dns_support=True,
                          tags={**tags, "Name": args.cluster_name}, opts=child)
        self.vpc_id = vpc.id
        pod_range = aws.ec2.VpcIpv4CidrBlockAssociation(f"{name}-pods", vpc_id=vpc.id, cidr_block=args.pod_cidr,
                                                        opts=child)
        igw = aws.ec2.InternetGateway(name, vpc_id=vpc.id, tags={**tags, "Name": args.cluster_name}, opts=child)
        public_subnets = self._subnets(name, args, tags, pod_range, igw)
        private_rts = self._private_routes(name, args, tags, igw, public_subnets)
        self.private_subnet_ids = [self.private_subnets[z].id for z in args.zones]
        self._endpoints(name, args, tags, private_rts)
        if args.flow_logs:
            self._flow_logs(name, args, tags)
        self.database_subnets = self._database_subnets(name, args, tags) if args.database_subnets else {}
        self.database_cidrs = [z.database for z in self.plan] if args.database_subnets else []
        self.register_outputs({"vpc_id": self.vpc_id, "private_subnet_ids": self.private_subnet_ids})

    def _subnets(self, name: str, args: NetworkArgs, tags: dict[str, str], pod_range: pulumi.Resource,
                 igw: aws.ec2.InternetGateway) -> dict[str, aws.ec2.Subnet]:
        """The public route table and each zone's public (NAT), node and pod subnets; returns the public ones."""
        child = pulumi.ResourceOptions(parent=self)
        public_rt = aws.ec2.RouteTable(f"{name}-public", vpc_id=self.vpc_id, tags={**tags, "Name": f"{name}-public"},
                                       opts=child)
        aws.ec2.Route(f"{name}-public-default", route_table_id=public_rt.id, destination_cidr_block="0.0.0.0/0",
                      gateway_id=igw.id, opts=child)
        discovery = {"karpenter.sh/discovery": args.cluster_name}
        public_subnets: dict[str, aws.ec2.Subnet] = {}
        self.private_subnets: dict[str, aws.ec2.Subnet] = {}
        self.pod_subnets: dict[str, aws.ec2.Subnet] = {}
        for z in self.plan:
            public_subnets[z.zone] = self._subnet(name, args, tags, "public", z.zone, z.public, "nat", child)
            aws.ec2.RouteTableAssociation(f"{name}-public-{z.zone}", subnet_id=public_subnets[z.zone].id,
                                          route_table_id=public_rt.id, opts=child)
            self.private_subnets[z.zone] = self._subnet(
                name, args, {**tags, **discovery, "kubernetes.io/role/internal-elb": "1"}, "private", z.zone,
                z.private, "nodes", child)
            self.pod_subnets[z.zone] = self._subnet(name, args, tags, "pods", z.zone, z.pods, "pods",
                                                    pulumi.ResourceOptions(parent=self, depends_on=[pod_range]))
        return public_subnets

    def _subnet(self, name: str, args: NetworkArgs, tags: dict[str, str], kind: str, zone: str, cidr: str, tier: str,
                opts: pulumi.ResourceOptions) -> aws.ec2.Subnet:
        """One subnet `<component>-<kind>-<zone>` tagged with its tier; no public address on launch."""
        return aws.ec2.Subnet(f"{name}-{kind}-{zone}", vpc_id=self.vpc_id, cidr_block=cidr, availability_zone=zone,
                              map_public_ip_on_launch=False, opts=opts,
                              tags={**tags, "Name": f"{args.cluster_name}-{kind}-{zone}", "gpu-train.io/tier": tier})

    def _private_routes(self, name: str, args: NetworkArgs, tags: dict[str, str], igw: aws.ec2.InternetGateway,
                        public_subnets: Mapping[str, aws.ec2.Subnet]) -> list[aws.ec2.RouteTable]:
        """The NAT gateways, and per zone a route table for its node and pod subnets through its (or the) NAT."""
        child = pulumi.ResourceOptions(parent=self)
        nats: dict[str, aws.ec2.NatGateway] = {}
        for zone in nat_zones(args.zones, args.nat):
            eip = aws.ec2.Eip(f"{name}-nat-{zone}", domain="vpc", tags={**tags, "Name": f"{name}-nat-{zone}"},
                              opts=child)
            nats[zone] = aws.ec2.NatGateway(f"{name}-{zone}", allocation_id=eip.id,
                                            subnet_id=public_subnets[zone].id,
                                            tags={**tags, "Name": f"{args.cluster_name}-{zone}"},
                                            opts=pulumi.ResourceOptions(parent=self, depends_on=[igw]))
        private_rts = []
        for z in self.plan:
            nat = nats.get(z.zone) or nats[next(iter(nats))]
            rt = aws.ec2.RouteTable(f"{name}-private-{z.zone}", vpc_id=self.vpc_id,
                                    tags={**tags, "Name": f"{name}-private-{z.zone}"}, opts=child)
            aws.ec2.Route(f"{name}-private-{z.zone}-default", route_table_id=rt.id,
                          destination_cidr_block="0.0.0.0/0", nat_gateway_id=nat.id, opts=child)
            for kind, subnet in (("nodes", self.private_subnets[z.zone]), ("pods", self.pod_subnets[z.zone])):
                aws.ec2.RouteTableAssociation(f"{name}-{kind}-{z.zone}", subnet_id=subnet.id, route_table_id=rt.id,
                                              opts=child)
            private_rts.append(rt)
        return private_rts

    def _endpoints(self, name: str, args: NetworkArgs, tags: dict[str, str],
                   private_rts: Sequence[aws.ec2.RouteTable]) -> None:
        """S3 as a free gateway endpoint on the private route tables; the rest as interface endpoints with
        private DNS, reachable on 443 from inside the VPC only (both CIDRs: pods use the secondary range)."""
        child = pulumi.ResourceOptions(parent=self)
        self.endpoint_sg = aws.ec2.SecurityGroup(
            f"{name}-endpoints", vpc_id=self.vpc_id, description="HTTPS from inside the VPC to AWS API endpoints",
            ingress=[aws.ec2.SecurityGroupIngressArgs(protocol="tcp", from_port=443, to_port=443,
                                                      cidr_blocks=[args.vpc_cidr, args.pod_cidr],
                                                      description="HTTPS from nodes and pods")],
            tags={**tags, "Name": f"{args.cluster_name}-endpoints"}, opts=child)
        aws.ec2.VpcEndpoint(f"{name}-s3", vpc_id=self.vpc_id, service_name=f"com.amazonaws.{args.region}.s3",
                            vpc_endpoint_type="Gateway", route_table_ids=[rt.id for rt in private_rts],
                            tags={**tags, "Name": f"{args.cluster_name}-s3"}, opts=child)
        for service in INTERFACE_ENDPOINTS:
            aws.ec2.VpcEndpoint(f"{name}-{service.replace('.', '-')}", vpc_id=self.vpc_id,
                                service_name=f"com.amazonaws.{args.region}.{service}",
                                vpc_endpoint_type="Interface", private_dns_enabled=True,
                                subnet_ids=self.private_subnet_ids, security_group_ids=[self.endpoint_sg.id],
                                tags={**tags, "Name": f"{args.cluster_name}-{service}"}, opts=child)

    def _flow_logs(self, name: str, args: NetworkArgs, tags: dict[str, str]) -> None:
        """VPC flow logs to an encrypted log group, written through a role scoped to that group."""
        child = pulumi.ResourceOptions(parent=self)
        log_group = aws.cloudwatch.LogGroup(f"{name}-flow-logs", name=f"/aws/vpc/{args.cluster_name}/flow-logs",
                                            retention_in_days=90, kms_key_id=args.logs_key_arn, tags=tags,
                                            opts=child)
        role = aws.iam.Role(f"{name}-flow-logs",
                            assume_role_policy=json.dumps(service_trust("vpc-flow-logs.amazonaws.com", args.account_id)),
                            tags=tags, opts=child)
        aws.iam.RolePolicy(f"{name}-flow-logs", role=role.id,
                           policy=log_group.arn.apply(lambda arn: json.dumps(flow_logs_policy(arn))),
                           opts=child)
        aws.ec2.FlowLog(f"{name}", vpc_id=self.vpc_id, traffic_type="ALL", log_destination_type="cloud-watch-logs",
                        log_destination=log_group.arn, iam_role_arn=role.arn, max_aggregation_interval=60,
                        tags=tags, opts=child)

    def _database_subnets(self, name: str, args: NetworkArgs, tags: dict[str, str]) -> dict[str, aws.ec2.Subnet]:
        """One small subnet per AZ, on a route table with only the VPC-local route (no NAT, no internet): a
        database here can answer clients inside the VPC and nothing else."""
        child = pulumi.ResourceOptions(parent=self)
        db_rt = aws.ec2.RouteTable(f"{name}-database", vpc_id=self.vpc_id,
                                   tags={**tags, "Name": f"{args.cluster_name}-database"}, opts=child)
        subnets = {}
        for z in self.plan:
            subnets[z.zone] = self._subnet(name, args, tags, "database", z.zone, z.database, "database", child)
            aws.ec2.RouteTableAssociation(f"{name}-database-{z.zone}", subnet_id=subnets[z.zone].id,
                                          route_table_id=db_rt.id, opts=child)
        return subnets
