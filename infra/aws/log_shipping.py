"""Where the team namespaces' container logs outlive their pods on EKS: one CloudWatch Logs group per team
namespace, and the identity of the shipper (Fluent Bit, installed by infra/k8s/log_shipping.py) that writes
them.

Usage (infra/aws/__init__.py):
    logs = LogShipping("log-shipping", LogShippingArgs(cluster_name=..., region=..., account_id=..., teams=[...],
                       logs_key_arn=keys.arns["logs"], retention_days=30, endpoint_cidrs=[vpc_cidr], ...))
    logs.store                 # infra.platform.LogStore: the platform field the Kubernetes layer installs from
    logs.reader_policy_arns    # team -> managed policy that reads only that team's logs

Each group is encrypted with the stack's logs key (whose key policy admits CloudWatch Logs for this
account's log groups, infra/aws/keys.py) and keeps events for `logs.retentionDays`. The shipper's role,
bound to its service account by EKS Pod Identity, may create streams in and put events to these groups
only: it cannot create groups (a typo'd name fails instead of making an unencrypted group without
retention) nor read anything back. Each team gets a managed policy that lets a principal read that team's
group, for the platform's administrators to attach to the team's roles (`gpu-train logs` uses it once a
pod is gone).

Pure functions, tested without mocks: `log_group_name`, `log_group_arn`, `shipper_policy`, `reader_policy`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from gpu_train.spec import naming
from infra.aws import iam
from infra.aws.identities import pod_identity_role
from infra.platform import LogStore, WorkloadIdentity

# The shipper's Kubernetes service account (the Kubernetes layer installs the chart with these names).
SHIPPER_NAMESPACE = "logging"
SHIPPER_SERVICE_ACCOUNT = "fluent-bit"


def log_group_name(cluster_name: str, namespace: str) -> str:
    """/gpu-train/<cluster>/<team namespace>: one group per team, so read access is granted per team."""
    return f"/gpu-train/{cluster_name}/{namespace}"


def log_group_arn(region: str, account_id: str, name: str) -> str:
    # https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazoncloudwatchlogs.html
    return f"arn:aws:logs:{region}:{account_id}:log-group:{name}"


def shipper_policy(group_arns: Sequence[str]) -> dict:
    """Fluent Bit's cloudwatch_logs output with auto_create_group off: create streams in, and put events
    to, exactly these groups (CreateLogStream and DescribeLogStreams act on the group, PutLogEvents on
    its streams)."""
    if not group_arns:
        raise ValueError("the log shipper needs at least one log group to write to")
    return iam._doc({
        "Sid": "WriteTeamLogs", "Effect": "Allow",
        "Action": ["logs:CreateLogStream", "logs:DescribeLogStreams", "logs:PutLogEvents"],
        "Resource": [r for arn in group_arns for r in (arn, f"{arn}:log-stream:*")],
    })


def reader_policy(group_arn: str) -> dict:
    """Read one team's container logs: find its streams and filter or page through their events."""
    return iam._doc({
        "Sid": "ReadTeamLogs", "Effect": "Allow",
        "Action": ["logs:DescribeLogStreams", "logs:FilterLogEvents", "logs:GetLogEvents"],
        "Resource": [group_arn, f"{group_arn}:log-stream:*"],
    })


@dataclass(frozen=True, kw_only=True)
class LogShippingArgs:
    cluster_name: str  # names the groups and scopes the Pod Identity association
    cluster: pulumi.Input[str]  # the EKS cluster's name as an Output, so the association waits for it
    region: str
    account_id: str
    teams: Sequence[str]  # team names (cfg.teams[].name)
    logs_key_arn: pulumi.Input[str]  # KMS key of every log group
    retention_days: int  # config.log_retention_days(cfg)
    endpoint_cidrs: Sequence[str]  # where pods reach CloudWatch Logs on 443 (the VPC interface endpoint)
    depends_on: Sequence[pulumi.Resource]  # the Pod Identity agent add-on
    tags: Mapping[str, str]


class LogShipping(pulumi.ComponentResource):
    store: LogStore
    reader_policy_arns: dict[str, pulumi.Output[str]]

    def __init__(self, name: str, args: LogShippingArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:LogShipping", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        groups: dict[str, str] = {}
        self.reader_policy_arns = {}
        for team in args.teams:
            namespace = naming.team_namespace(team)
            group = log_group_name(args.cluster_name, namespace)
            groups[namespace] = group
            aws.cloudwatch.LogGroup(
                f"{name}-{team}", name=group, retention_in_days=args.retention_days, kms_key_id=args.logs_key_arn,
                tags=tags, opts=child)
            arn = log_group_arn(args.region, args.account_id, group)
            self.reader_policy_arns[team] = aws.iam.Policy(
                f"{name}-{team}-reader", name=f"{args.cluster_name}-{team}-logs-read"[:128],
                description=f"Read the container logs of team {team} on {args.cluster_name}",
                policy=json.dumps(reader_policy(arn)), tags=tags, opts=child).arn

        arns = [log_group_arn(args.region, args.account_id, g) for g in groups.values()]
        self.role, self.association = pod_identity_role(
            f"{name}-shipper", parent=self, role_name=f"{args.cluster_name}-log-shipper"[:64],
            account_id=args.account_id, policy=json.dumps(shipper_policy(arns)), cluster_name=args.cluster,
            namespace=SHIPPER_NAMESPACE, service_account=SHIPPER_SERVICE_ACCOUNT, depends_on=args.depends_on,
            tags=tags)
        self.store = LogStore(
            kind="cloudwatch", region=args.region, groups=groups,
            shipper=WorkloadIdentity(namespaces=[SHIPPER_NAMESPACE], name=SHIPPER_SERVICE_ACCOUNT),
            endpoint_cidrs=list(args.endpoint_cidrs))
        self.register_outputs({"log_groups": groups, "role": self.role.arn})
