"""Karpenter provisions every GPU pool: an EC2NodeClass and its NodePools per pool, and the interruption queue.

Usage:
    karp = Karpenter("karpenter", KarpenterArgs(...))      # CRDs, controller, queue, IAM, classes and pools
    node_class_spec(...), node_pools(...), helm_values(...) # pure: the custom resources and chart values

Karpenter launches nodes only when pending pods need them and removes them when empty, so pools cost
nothing while idle. Since v1.11 an EC2NodeClass can declare the network interfaces of its nodes
(`networkInterfaces`), select a placement group (`placementGroupSelector`) and launch into capacity
reservations and capacity blocks (`capacityReservationSelectorTerms` with capacity type `reserved`), so
EFA pools and reserved capacity need no managed node group any more:

- fabric pools: one EFA device per network card (`gpu_nodes.efa_interfaces`), the EFA security group
  next to the cluster's, and, on spot / on-demand capacity, a cluster placement group created here;
- reservation and capacity-block pools: the reservation by id, capacity type `reserved` (a capacity
  block is a reservation to EC2 and to Karpenter, https://karpenter.sh/docs/tasks/odcrs/); the
  reservation fixes where its instances land, so no placement group is added;
- `minNodes` > 0: a static NodePool (`spec.replicas` = minNodes, Karpenter's StaticCapacity feature,
  alpha in 1.14 and turned on here only when a pool needs it) keeps that many nodes up; a dynamic
  NodePool with the same labels adds up to maxNodes - minNodes on demand. Both use the pool's
  EC2NodeClass; the job selects them by the pool label, so it does not see the split.

Node repair (`gpu-train:health.nodeRepair`, Karpenter's `nodeRepair` feature gate, alpha and off by default in
1.14.1): Karpenter replaces a node whose `Ready` condition is False or Unknown for 30 minutes, or on which the EKS
node monitoring agent reports `AcceleratedHardwareReady=False` for 10 minutes (or `StorageReady`,
`NetworkingReady`, `KernelReady`, `ContainerRuntimeReady` False for 30), unless more than 20% of the NodePool's
nodes are unhealthy (`RepairPolicies` in pkg/cloudprovider/cloudprovider.go at v1.14.1; the 20% in
sigs.k8s.io/karpenter pkg/controllers/node/health). Karpenter deletes a repaired node's pods with a 1 s grace
period, so the Kubernetes layer's quarantine (infra/k8s/health.py) evicts training pods with their own grace
period as soon as the condition appears, well inside those 10 minutes. The dynamic NodePools' disruption
budget (`gpu-train:health.maxConcurrentRepairs` nodes) bounds how many emptied or drifted nodes of a pool
Karpenter removes at once.

EventBridge forwards spot interruption warnings, rebalance recommendations, instance state changes,
AWS Health events and capacity-reservation interruptions to an SQS queue (encrypted with the sqs key)
that Karpenter drains so it can cordon and replace nodes before they go away
(https://karpenter.sh/docs/concepts/disruption/#interruption). The CRDs come from the separate
`karpenter-crd` chart, because Helm installs a chart's own crds/ only once and never upgrades them
(https://karpenter.sh/docs/upgrading/upgrade-guide/#crd-upgrades).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.catalog.aws import InstanceSpec, instance_spec
from gpu_train.spec.settings import GpuPoolSettings, HealthSettings
from infra.aws import iam
from infra.aws.gpu_nodes import (
    GPU_ROOT_GB,
    Interface,
    efa_interfaces,
    efa_security_group_rules,
    node_labels,
    nvidia_ami_parameter,
)
from infra.aws.identities import pod_identity_role

CHART = "oci://public.ecr.aws/karpenter/karpenter"
CRD_CHART = "oci://public.ecr.aws/karpenter/karpenter-crd"
CHART_VERSION = "1.14.1"  # the controller, the CRDs and iam.karpenter_controller_policy follow this release
CONSOLIDATE_AFTER = "5m"
EXPIRE_AFTER = "720h"  # replace nodes monthly (AMI and kernel updates)
# The pool's capacity setting -> Karpenter's karpenter.sh/capacity-type.
CAPACITY_TYPES = {"spot": "spot", "on-demand": "on-demand", "reservation": "reserved", "capacity-block": "reserved"}
# Tag that marks the cluster's EFA security group, by which fabric EC2NodeClasses select it.
EFA_GROUP_TAG = "gpu-train.io/efa"

# EventBridge patterns Karpenter handles (the rules of its v1.14.1 reference CloudFormation template).
EVENT_PATTERNS = {
    "spot-interruption": {"source": ["aws.ec2"], "detail-type": ["EC2 Spot Instance Interruption Warning"]},
    "rebalance": {"source": ["aws.ec2"], "detail-type": ["EC2 Instance Rebalance Recommendation"]},
    "instance-state": {"source": ["aws.ec2"], "detail-type": ["EC2 Instance State-change Notification"]},
    "health": {"source": ["aws.health"], "detail-type": ["AWS Health Event"]},
    "capacity-reservation": {"source": ["aws.ec2"],
                             "detail-type": ["EC2 Capacity Reservation Instance Interruption Warning"]},
}


def queue_policy(queue_arn: str) -> dict:
    """Only EventBridge (and SQS itself) may send; nothing over plain HTTP."""
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "EventBridgeSend", "Effect": "Allow",
         "Principal": {"Service": ["events.amazonaws.com", "sqs.amazonaws.com"]},
         "Action": "sqs:SendMessage", "Resource": queue_arn},
        {"Sid": "DenyInsecureTransport", "Effect": "Deny", "Principal": "*", "Action": "sqs:*",
         "Resource": queue_arn, "Condition": {"Bool": {"aws:SecureTransport": "false"}}},
    ]}


def helm_values(*, cluster_name: str, endpoint: str, queue_name: str, system_selector: Mapping[str, str],
                static_capacity: bool, node_repair: bool = False) -> dict:
    """Chart values: Pod Identity (no IRSA annotation), HA controller on the system nodes; node repair
    when asked (the chart's default leaves it off)."""
    gates = {"reservedCapacity": True, "staticCapacity": static_capacity}
    if node_repair:
        gates["nodeRepair"] = True
    return {
        "settings": {
            "clusterName": cluster_name, "clusterEndpoint": endpoint, "interruptionQueue": queue_name,
            # VPC CNI custom networking keeps the primary ENI for the node only, so max-pods must not
            # count it (https://karpenter.sh/docs/concepts/nodeclasses/, pod density).
            "reservedENIs": "1",
            "featureGates": gates,
        },
        "serviceAccount": {"create": True, "name": naming.KARPENTER_SERVICE_ACCOUNT},
        "replicas": 2,
        "nodeSelector": dict(system_selector),
        "controller": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                                     "limits": {"cpu": "1", "memory": "1Gi"}}},
        "podDisruptionBudget": {"name": "karpenter", "maxUnavailable": 1},
    }


def placement_group_name(cluster_name: str, pool: GpuPoolSettings) -> str:
    return f"{cluster_name}-{pool.name}"


def wants_placement_group(pool: GpuPoolSettings) -> bool:
    """Fabric pools on spot / on-demand capacity get a cluster placement group; a reservation already
    decides where its instances land (and launching it into another group would fail)."""
    return pool.fabric and pool.placement_group and pool.capacity in ("spot", "on-demand")


def node_class_spec(*, cluster_name: str, node_role_name: str, ami_id: str, ebs_key_arn: str,
                    tags: Mapping[str, str], interfaces: Sequence[Interface] = (), efa_group: bool = False,
                    placement_group: str = "", reservation_id: str = "") -> dict:
    """EC2NodeClass (karpenter.k8s.aws/v1) spec: NVIDIA AL2023 AMI, encrypted root, IMDSv2, NVMe RAID0,
    and for fabric pools the EFA interfaces, the EFA security group and the placement group."""
    discovery = {"tags": {"karpenter.sh/discovery": cluster_name}}
    spec: dict = {
        "role": node_role_name,
        "amiFamily": "AL2023",
        "amiSelectorTerms": [{"id": ami_id}],
        "subnetSelectorTerms": [discovery],
        # Terms are ORed: the cluster security group (by its discovery tag), and for fabric pools the
        # EFA group (by its own tag).
        "securityGroupSelectorTerms": [discovery] + ([{"tags": {EFA_GROUP_TAG: cluster_name}}] if efa_group else []),
        "associatePublicIPAddress": False,
        # Hop limit 1: pods cannot reach the node role's credentials; Pod Identity serves theirs.
        "metadataOptions": {"httpEndpoint": "enabled", "httpProtocolIPv6": "disabled",
                            "httpPutResponseHopLimit": 1, "httpTokens": "required"},
        "blockDeviceMappings": [{"deviceName": "/dev/xvda", "ebs": {
            "volumeSize": f"{GPU_ROOT_GB}Gi", "volumeType": "gp3", "encrypted": True, "kmsKeyID": ebs_key_arn,
            "deleteOnTermination": True}}],
        # nodeadm RAID0s the instance-store disks and mounts them at /mnt/k8s-disks/0.
        "instanceStorePolicy": "RAID0",
        "tags": dict(tags),
    }
    if interfaces:
        spec["networkInterfaces"] = [{"networkCardIndex": i.network_card_index, "deviceIndex": i.device_index,
                                      "interfaceType": i.interface_type} for i in interfaces]
    if placement_group:
        spec["placementGroupSelector"] = {"name": placement_group}
    if reservation_id:
        spec["capacityReservationSelectorTerms"] = [{"id": reservation_id}]
    return spec


def _template(pool: GpuPoolSettings, spec: InstanceSpec, node_class: str, zones: Sequence[str]) -> dict:
    taint = naming.GPU_TAINT
    return {
        "metadata": {"labels": node_labels(pool, spec)},
        "spec": {
            "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": node_class},
            "requirements": [
                {"key": "karpenter.sh/capacity-type", "operator": "In", "values": [CAPACITY_TYPES[pool.capacity]]},
                {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": [pool.instance_type]},
                {"key": "topology.kubernetes.io/zone", "operator": "In",
                 "values": [pool.zone] if pool.zone else list(zones)},
            ],
            "taints": [{"key": taint["key"], "value": taint["value"], "effect": taint["effect"]}],
            "expireAfter": EXPIRE_AFTER,
        },
    }


def node_pools(pool: GpuPoolSettings, spec: InstanceSpec, *, node_class: str, zones: Sequence[str],
               max_disrupted: int | None = None) -> dict[str, dict]:
    """NodePool (karpenter.sh/v1) specs for one pool, by NodePool name (pure).

    `<pool>`: dynamic, 0..(maxNodes - minNodes) nodes, bounded by an nvidia.com/gpu limit, empty nodes
    removed after CONSOLIDATE_AFTER, at most `max_disrupted` at once when given (a disruption budget; Karpenter's
    default is 10% of the pool). `<pool>-static` (only when minNodes > 0): a static NodePool that
    keeps exactly minNodes nodes (limits.nodes, the only limit a static NodePool takes, stops a drift
    replacement from overshooting).
    """
    if pool.capacity not in CAPACITY_TYPES:
        raise ValueError(f"pool {pool.name!r}: capacity {pool.capacity!r} has no Karpenter capacity type")
    if max_disrupted is not None and max_disrupted < 1:
        raise ValueError(f"pool {pool.name!r}: at least one node must be removable at once (got {max_disrupted})")
    if pool.min_nodes < 0 or pool.max_nodes < max(pool.min_nodes, 1):
        raise ValueError(f"pool {pool.name!r}: needs 0 <= minNodes <= maxNodes and maxNodes >= 1 "
                         f"(got {pool.min_nodes}..{pool.max_nodes})")
    template = _template(pool, spec, node_class, zones)
    out: dict[str, dict] = {}
    if pool.min_nodes > 0:
        out[f"{pool.name}-static"] = {
            "replicas": pool.min_nodes,
            "template": template,
            "limits": {"nodes": str(pool.min_nodes)},
            # Consolidation does not apply to static NodePools; the field is required, so it says so.
            "disruption": {"consolidateAfter": "Never"},
        }
    dynamic = pool.max_nodes - pool.min_nodes
    if dynamic > 0:
        out[pool.name] = {
            "template": template,
            # The GPU limit caps this NodePool at its share of maxNodes instances.
            "limits": {"nvidia.com/gpu": str(dynamic * spec.gpus)},
            # Only empty nodes are removed: a running training job is never consolidated away (jobs
            # also carry karpenter.sh/do-not-disrupt).
            "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": CONSOLIDATE_AFTER},
        }
        if max_disrupted is not None:
            out[pool.name]["disruption"]["budgets"] = [{"nodes": str(max_disrupted)}]
    return out


@dataclass(frozen=True, kw_only=True)
class KarpenterArgs:
    cluster_name: str  # EKS cluster name (discovery tag value)
    cluster_arn: pulumi.Input[str]  # for eks:DescribeCluster
    endpoint: pulumi.Input[str]  # API server URL
    region: str  # region scoping of the controller policy
    account_id: str  # for ARNs and trust
    vpc_id: pulumi.Input[str]  # for the EFA security group
    zones: Sequence[str]  # default zones for pools without one
    controller_role_name: str  # IAM role name of the controller
    sqs_key_arn: pulumi.Input[str]  # interruption queue encryption
    ebs_key_arn: pulumi.Input[str]  # node volume encryption
    kubernetes_version: str  # selects the NVIDIA AMI
    provider: k8s.Provider  # the cluster's Kubernetes provider
    system_selector: Mapping[str, str]  # where the controller runs
    pools: Sequence[GpuPoolSettings]  # every GPU pool of the stack
    network_cards: Mapping[str, int]  # network cards of each fabric pool's instance type (EC2), by pool name
    depends_on: Sequence[pulumi.Resource]  # add-ons and system nodes that must exist first
    tags: Mapping[str, str]  # common tags
    health: HealthSettings = field(default_factory=HealthSettings)  # node repair and repair budget (cfg.health)


class Karpenter(pulumi.ComponentResource):
    def __init__(self, name: str, args: KarpenterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Karpenter", name, None, opts)
        tags = dict(args.tags)
        queue = self._interruption_queue(name, args, tags)
        self._controller(name, args, tags, queue)
        self.efa_security_group = self._efa_security_group(name, args, tags) \
            if any(p.fabric for p in args.pools) else None
        ami = aws.ssm.get_parameter(name=nvidia_ami_parameter(args.kubernetes_version),
                                    opts=pulumi.InvokeOptions(parent=self)).value
        self.node_pools: list[k8s.apiextensions.CustomResource] = []
        for pool in args.pools:
            self._pool(name, args, tags, pool, ami)
        self.register_outputs({"queue_url": queue.url, "release": self.release.name})

    def _interruption_queue(self, name: str, args: KarpenterArgs, tags: dict[str, str]) -> aws.sqs.Queue:
        """The encrypted interruption queue, and the EventBridge rules that forward EVENT_PATTERNS to it."""
        child = pulumi.ResourceOptions(parent=self)
        queue = aws.sqs.Queue(f"{name}-interruptions", name=f"{args.cluster_name}-karpenter",
                              message_retention_seconds=300, kms_master_key_id=args.sqs_key_arn,
                              kms_data_key_reuse_period_seconds=300, tags=tags, opts=child)
        aws.sqs.QueuePolicy(f"{name}-interruptions", queue_url=queue.url,
                            policy=queue.arn.apply(lambda a: json.dumps(queue_policy(a))), opts=child)
        for event, pattern in EVENT_PATTERNS.items():
            rule = aws.cloudwatch.EventRule(f"{name}-{event}", description=f"Karpenter: {event}",
                                            event_pattern=json.dumps(pattern), tags=tags, opts=child)
            aws.cloudwatch.EventTarget(f"{name}-{event}", rule=rule.name, arn=queue.arn, target_id="karpenter",
                                       opts=child)
        return queue

    def _controller(self, name: str, args: KarpenterArgs, tags: dict[str, str], queue: aws.sqs.Queue) -> None:
        """The nodes' role and access entry, the controller's role and Pod Identity, then both charts."""
        child = pulumi.ResourceOptions(parent=self)
        self.node_role = node_role = aws.iam.Role(
            f"{name}-nodes", name=f"{args.cluster_name}-karpenter-nodes",
            assume_role_policy=json.dumps(iam.service_trust("ec2.amazonaws.com")), tags=tags, opts=child)
        for i, arn in enumerate(iam.NODE_MANAGED_POLICIES):
            aws.iam.RolePolicyAttachment(f"{name}-nodes-{i}", role=node_role.name, policy_arn=arn, opts=child)
        entry = aws.eks.AccessEntry(f"{name}-nodes", cluster_name=args.cluster_name, principal_arn=node_role.arn,
                                    type="EC2_LINUX", tags=tags,
                                    opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.depends_on)))
        policy = pulumi.Output.all(
            args.cluster_arn, node_role.arn, queue.arn, args.ebs_key_arn, args.sqs_key_arn).apply(
            lambda a: json.dumps(iam.karpenter_controller_policy(
                cluster_name=args.cluster_name, cluster_arn=a[0], region=args.region, account_id=args.account_id,
                node_role_arn=a[1], queue_arn=a[2], ebs_key_arn=a[3], sqs_key_arn=a[4])))
        _, association = pod_identity_role(
            f"{name}-controller", parent=self, role_name=args.controller_role_name, account_id=args.account_id,
            policy=policy, cluster_name=args.cluster_name, namespace=naming.KARPENTER_NAMESPACE,
            service_account=naming.KARPENTER_SERVICE_ACCOUNT, depends_on=args.depends_on, tags=tags)
        self.crds = k8s.helm.v3.Release(
            f"{name}-crd", name="karpenter-crd", chart=CRD_CHART, version=CHART_VERSION,
            namespace=naming.KARPENTER_NAMESPACE, atomic=True, timeout=300,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=list(args.depends_on)))
        static = any(p.min_nodes > 0 for p in args.pools)
        values = pulumi.Output.all(args.endpoint, queue.name).apply(lambda a: helm_values(
            cluster_name=args.cluster_name, endpoint=a[0], queue_name=a[1], system_selector=args.system_selector,
            static_capacity=static, node_repair=args.health.node_repair))
        self.release = k8s.helm.v3.Release(
            name, name="karpenter", chart=CHART, version=CHART_VERSION, namespace=naming.KARPENTER_NAMESPACE,
            # An OCI chart: the registry is in `chart`, so there is no repository to configure. The CRDs
            # belong to the karpenter-crd release above.
            values=values, skip_crds=True, atomic=True, timeout=600,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider,
                                        depends_on=[*args.depends_on, association, entry, self.crds]))

    def _efa_security_group(self, name: str, args: KarpenterArgs, tags: dict[str, str]) -> aws.ec2.SecurityGroup:
        """The security group of fabric nodes' EFA interfaces: all traffic between its members."""
        child = pulumi.ResourceOptions(parent=self)
        sg = aws.ec2.SecurityGroup(f"{name}-efa", vpc_id=args.vpc_id, description="EFA: all traffic within the group",
                                   tags={**tags, "Name": f"{args.cluster_name}-efa",
                                         EFA_GROUP_TAG: args.cluster_name}, opts=child)
        for rule in efa_security_group_rules():
            cls = aws.vpc.SecurityGroupIngressRule if rule["direction"] == "ingress" else \
                aws.vpc.SecurityGroupEgressRule
            cls(f"{name}-efa-self-{rule['direction']}", security_group_id=sg.id, ip_protocol=rule["ip_protocol"],
                referenced_security_group_id=sg.id, description="EFA peers", tags=tags, opts=child)
        return sg

    def _pool(self, name: str, args: KarpenterArgs, tags: dict[str, str], pool: GpuPoolSettings, ami: str) -> None:
        """One GPU pool: its placement group when it wants one, its EC2NodeClass and NodePools."""
        class_name = f"gpu-{pool.name}"
        interfaces = efa_interfaces(args.network_cards[pool.name]) if pool.fabric else []
        group_name: pulumi.Input[str] = ""
        if wants_placement_group(pool):
            pg = aws.ec2.PlacementGroup(f"{name}-{pool.name}", name=placement_group_name(args.cluster_name, pool),
                                        strategy="cluster", tags=tags, opts=pulumi.ResourceOptions(parent=self))
            group_name = pg.name
        class_spec = pulumi.Output.all(args.ebs_key_arn, self.node_role.name, group_name).apply(
            lambda a: node_class_spec(
                cluster_name=args.cluster_name, node_role_name=a[1], ami_id=ami, ebs_key_arn=a[0], tags=tags,
                interfaces=interfaces, efa_group=pool.fabric, placement_group=a[2],
                reservation_id=pool.reservation_id))
        # A fabric node class selects the EFA group by tag, so it must exist (tagged) first.
        class_deps = [self.release] + ([self.efa_security_group] if pool.fabric else [])
        node_class = k8s.apiextensions.CustomResource(
            f"{name}-class-{pool.name}", api_version="karpenter.k8s.aws/v1", kind="EC2NodeClass",
            metadata={"name": class_name}, spec=class_spec,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=class_deps))
        pool_opts = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[self.release, node_class])
        spec = instance_spec(pool.instance_type)
        for pool_name, pool_spec in node_pools(pool, spec, node_class=class_name, zones=args.zones,
                                               max_disrupted=args.health.max_concurrent_repairs).items():
            self.node_pools.append(k8s.apiextensions.CustomResource(
                f"{name}-pool-{pool_name}", api_version="karpenter.sh/v1", kind="NodePool",
                metadata={"name": pool_name}, spec=pool_spec, opts=pool_opts))
