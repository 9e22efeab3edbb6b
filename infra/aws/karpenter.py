"""Karpenter for elastic (spot / on-demand, non-fabric) GPU pools, with its interruption queue.

Usage:
    karp = Karpenter("karpenter", KarpenterArgs(...))   # Helm release + EC2NodeClass/NodePool per pool
    node_class_spec(...), node_pool_spec(...)            # pure: the custom resources' specs

Karpenter launches nodes only when pending pods need them and removes them when empty, so these
pools cost nothing while idle. EventBridge forwards spot interruption warnings, rebalance
recommendations, instance state changes, AWS Health events and capacity-reservation interruptions
to an SQS queue (encrypted with the SQS key) that Karpenter drains so it can cordon and replace
nodes before they go away. https://karpenter.sh/docs/concepts/disruption/#interruption
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra import naming
from infra.aws import iam
from infra.aws.catalog import InstanceSpec
from infra.aws.gpu_nodes import GPU_ROOT_GB, node_labels, nvidia_ami_parameter
from infra.config import GpuPoolConfig

CHART = "oci://public.ecr.aws/karpenter/karpenter"
CHART_VERSION = "1.8.1"
CONSOLIDATE_AFTER = "5m"
EXPIRE_AFTER = "720h"  # replace nodes monthly (AMI and kernel updates)

# EventBridge patterns Karpenter handles (https://karpenter.sh/docs/reference/cloudformation/).
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


def helm_values(*, cluster_name: str, endpoint: str, queue_name: str, system_selector: Mapping[str, str]) -> dict:
    """Chart values: Pod Identity (no IRSA annotation), HA controller on the system nodes."""
    return {
        "settings": {"clusterName": cluster_name, "clusterEndpoint": endpoint, "interruptionQueue": queue_name},
        "serviceAccount": {"create": True, "name": naming.KARPENTER_SERVICE_ACCOUNT},
        "replicas": 2,
        "nodeSelector": dict(system_selector),
        "controller": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                                     "limits": {"cpu": "1", "memory": "1Gi"}}},
        "podDisruptionBudget": {"name": "karpenter", "maxUnavailable": 1},
    }


def node_class_spec(*, cluster_name: str, node_role_name: str, ami_id: str, ebs_key_arn: str,
                    tags: Mapping[str, str]) -> dict:
    """EC2NodeClass (karpenter.k8s.aws/v1) spec: NVIDIA AL2023 AMI, encrypted root, IMDSv2, NVMe RAID0."""
    discovery = {"tags": {"karpenter.sh/discovery": cluster_name}}
    return {
        "role": node_role_name,
        "amiFamily": "AL2023",
        "amiSelectorTerms": [{"id": ami_id}],
        "subnetSelectorTerms": [discovery],
        "securityGroupSelectorTerms": [discovery],
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


def node_pool_spec(pool: GpuPoolConfig, spec: InstanceSpec, *, node_class: str, zones: Sequence[str]) -> dict:
    """NodePool (karpenter.sh/v1) spec for one elastic pool: scale 0..maxNodes, empty nodes removed."""
    if pool.capacity not in ("spot", "on-demand"):
        raise ValueError(f"pool {pool.name!r}: capacity {pool.capacity!r} is served by a managed node group")
    taint = naming.GPU_TAINT
    return {
        "template": {
            "metadata": {"labels": node_labels(pool, spec)},
            "spec": {
                "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": node_class},
                "requirements": [
                    {"key": "karpenter.sh/capacity-type", "operator": "In", "values": [pool.capacity]},
                    {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": [pool.instance_type]},
                    {"key": "topology.kubernetes.io/zone", "operator": "In",
                     "values": [pool.zone] if pool.zone else list(zones)},
                ],
                "taints": [{"key": taint["key"], "value": taint["value"], "effect": taint["effect"]}],
                "expireAfter": EXPIRE_AFTER,
            },
        },
        # The GPU limit caps the pool at maxNodes instances.
        "limits": {"nvidia.com/gpu": str(pool.max_nodes * spec.gpus)},
        # Only empty nodes are removed: a running training job is never consolidated away (jobs also
        # carry karpenter.sh/do-not-disrupt).
        "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": CONSOLIDATE_AFTER},
    }


@dataclass(frozen=True, kw_only=True)
class KarpenterArgs:
    cluster_name: str  # EKS cluster name (discovery tag value)
    cluster_arn: pulumi.Input[str]  # for eks:DescribeCluster
    endpoint: pulumi.Input[str]  # API server URL
    region: str  # region scoping of the controller policy
    account_id: str  # for ARNs and trust
    zones: Sequence[str]  # default zones for pools without one
    controller_role_name: str  # IAM role name (also listed in the EBS key policy)
    sqs_key_arn: pulumi.Input[str]  # interruption queue encryption
    ebs_key_arn: pulumi.Input[str]  # node volume encryption
    kubernetes_version: str  # selects the NVIDIA AMI
    provider: k8s.Provider  # the cluster's Kubernetes provider
    system_selector: Mapping[str, str]  # where the controller runs
    pools: Sequence[tuple[GpuPoolConfig, InstanceSpec]]  # pools with provisioner "karpenter"
    depends_on: Sequence[pulumi.Resource]  # add-ons and system nodes that must exist first
    tags: Mapping[str, str]  # common tags


class Karpenter(pulumi.ComponentResource):
    def __init__(self, name: str, args: KarpenterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Karpenter", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
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

        node_role = aws.iam.Role(f"{name}-nodes", name=f"{args.cluster_name}-karpenter-nodes",
                                 assume_role_policy=json.dumps(iam.service_trust("ec2.amazonaws.com")), tags=tags,
                                 opts=child)
        for i, arn in enumerate(iam.NODE_MANAGED_POLICIES):
            aws.iam.RolePolicyAttachment(f"{name}-nodes-{i}", role=node_role.name, policy_arn=arn, opts=child)
        # Nodes Karpenter launches join through this access entry (API authentication mode).
        entry = aws.eks.AccessEntry(f"{name}-nodes", cluster_name=args.cluster_name, principal_arn=node_role.arn,
                                    type="EC2_LINUX", tags=tags,
                                    opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.depends_on)))

        controller = aws.iam.Role(f"{name}-controller", name=args.controller_role_name,
                                  assume_role_policy=json.dumps(iam.pod_identity_trust(args.account_id)), tags=tags,
                                  opts=child)
        aws.iam.RolePolicy(f"{name}-controller", role=controller.id, policy=pulumi.Output.all(
            args.cluster_arn, node_role.arn, queue.arn, args.ebs_key_arn).apply(
            lambda a: json.dumps(iam.karpenter_controller_policy(
                cluster_name=args.cluster_name, cluster_arn=a[0], region=args.region, account_id=args.account_id,
                node_role_arn=a[1], queue_arn=a[2], ebs_key_arn=a[3]))), opts=child)
        association = aws.eks.PodIdentityAssociation(
            f"{name}-controller", cluster_name=args.cluster_name, namespace=naming.KARPENTER_NAMESPACE,
            service_account=naming.KARPENTER_SERVICE_ACCOUNT, role_arn=controller.arn, tags=tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=list(args.depends_on)))

        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.provider,
                                          depends_on=[*args.depends_on, association, entry])
        values = pulumi.Output.all(args.endpoint, queue.name).apply(lambda a: helm_values(
            cluster_name=args.cluster_name, endpoint=a[0], queue_name=a[1], system_selector=args.system_selector))
        self.release = k8s.helm.v3.Release(
            name, name="karpenter", chart=CHART, version=CHART_VERSION, namespace=naming.KARPENTER_NAMESPACE,
            # An OCI chart: the registry is in `chart`, so there is no repository to configure.
            values=values, atomic=True,
            timeout=600, opts=k8s_opts)

        ami = aws.ssm.get_parameter(name=nvidia_ami_parameter(args.kubernetes_version)).value
        cr_opts = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[self.release])
        self.node_pools = []
        for pool, spec in args.pools:
            class_name = f"gpu-{pool.name}"
            class_spec = pulumi.Output.all(args.ebs_key_arn, node_role.name).apply(lambda a: node_class_spec(
                cluster_name=args.cluster_name, node_role_name=a[1], ami_id=ami, ebs_key_arn=a[0], tags=tags))
            k8s.apiextensions.CustomResource(f"{name}-class-{pool.name}", api_version="karpenter.k8s.aws/v1",
                                             kind="EC2NodeClass", metadata={"name": class_name}, spec=class_spec,
                                             opts=cr_opts)
            self.node_pools.append(k8s.apiextensions.CustomResource(
                f"{name}-pool-{pool.name}", api_version="karpenter.sh/v1", kind="NodePool",
                metadata={"name": pool.name},
                spec=node_pool_spec(pool, spec, node_class=class_name, zones=args.zones), opts=cr_opts))
        self.queue_url = queue.url
        self.register_outputs({"queue_url": queue.url, "release": self.release.name})
