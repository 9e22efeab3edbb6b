"""Customer-managed KMS keys, one per purpose, with rotation, a deletion window and least-privilege policies.

Usage:
    keys = Keys("keys", KeysArgs(prefix="gpu-train-aws-dev", account_id=..., region=..., tags=...))
    keys.arns["s3"]  # Output[str]

Purposes: eks (Kubernetes secrets), ebs (node and persistent volumes), s3 (buckets), logs
(CloudWatch log groups), sqs (Karpenter interruption queue), ecr (image repository), and rds
(the managed MLflow database and its Performance Insights data; created only when the stack asks
for a managed database, see `OPTIONAL_PURPOSES`). The key policies are pure functions (`key_policy`) so tests read them without mocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

PURPOSES = ("eks", "ebs", "s3", "logs", "sqs", "ecr", "rds")
# Keys that exist only when a feature needs them (an unused key still costs a monthly fee).
OPTIONAL_PURPOSES = ("rds",)
DELETION_WINDOW_DAYS = 30


def _root_admin(account_id: str) -> dict:
    # The account root statement lets IAM policies in this account grant key use; without it the
    # key becomes unmanageable. https://docs.aws.amazon.com/kms/latest/developerguide/key-policy-default.html
    return {
        "Sid": "AccountAdministration",
        "Effect": "Allow",
        "Principal": {"AWS": f"arn:aws:iam::{account_id}:root"},
        "Action": "kms:*",
        "Resource": "*",
    }


def key_policy(purpose: str, *, account_id: str, region: str, volume_service_roles: Sequence[str] = ()) -> dict:
    """The key policy for one purpose (pure).

    `volume_service_roles` (ebs only): service-linked roles that launch instances with volumes encrypted
    by this key on our behalf (EC2 Auto Scaling's, for the managed system node group). They are named
    as principals: a service-linked role's own policy cannot be edited and grants no use of customer
    keys, so delegating to the account root (which needs an IAM allow on the principal's side) cannot
    reach it. The role must exist when the policy is written, which `ServiceLinkedRoles` ensures.
    """
    if purpose not in PURPOSES:
        raise ValueError(f"unknown KMS key purpose {purpose!r} (known: {', '.join(PURPOSES)})")
    statements = [_root_admin(account_id)]
    use = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"]
    if purpose == "logs":
        # CloudWatch Logs uses the key only for log groups of this account and region. The
        # encryption-context key exists on the cryptographic operations only (not on DescribeKey), and
        # is a string key, so it is matched with StringLike.
        # https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html
        statements.append({
            "Sid": "CloudWatchLogs",
            "Effect": "Allow",
            "Principal": {"Service": f"logs.{region}.amazonaws.com"},
            "Action": ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*"],
            "Resource": "*",
            "Condition": {"StringLike": {
                "kms:EncryptionContext:aws:logs:arn": f"arn:aws:logs:{region}:{account_id}:log-group:*"}},
        })
    elif purpose == "sqs":
        # EventBridge must encrypt the messages it sends to a KMS-encrypted queue.
        # https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-troubleshooting.html
        statements.append({
            "Sid": "EventBridgeToSqs",
            "Effect": "Allow",
            "Principal": {"Service": "events.amazonaws.com"},
            "Action": ["kms:Decrypt", "kms:GenerateDataKey*"],
            "Resource": "*",
            "Condition": {"StringEquals": {"aws:SourceAccount": account_id}},
        })
    elif purpose == "ebs":
        # The two statements EC2 Auto Scaling documents for its service-linked role: use of the key,
        # and grants for the volumes it attaches.
        # https://docs.aws.amazon.com/autoscaling/ec2/userguide/key-policy-requirements-EBS-encryption.html
        # Roles in this account that create volumes (Karpenter's controller, the EBS CSI driver) get
        # their use from the account-root statement plus their own IAM policies.
        if volume_service_roles:
            principal = {"AWS": sorted(volume_service_roles)}
            statements.append({"Sid": "ServiceLinkedRoleUse", "Effect": "Allow", "Principal": principal,
                               "Action": use, "Resource": "*"})
            statements.append({"Sid": "ServiceLinkedRoleGrants", "Effect": "Allow", "Principal": principal,
                               "Action": "kms:CreateGrant", "Resource": "*",
                               "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}}})
    elif purpose in ("s3", "ecr", "eks", "rds"):
        # Used by the service on behalf of callers, through the caller's IAM permissions, only via
        # that service (kms:ViaService): a role with kms:Decrypt cannot use the key directly.
        # For rds this covers storage encryption, automated backups, snapshots and Performance
        # Insights: RDS uses the key through grants it creates as the caller.
        # https://docs.aws.amazon.com/AmazonRDS/latest/UserGuide/Overview.Encryption.Keys.html
        service = purpose
        statements.append({
            "Sid": f"AccountUseVia{service.upper()}",
            "Effect": "Allow",
            "Principal": {"AWS": f"arn:aws:iam::{account_id}:root"},
            "Action": [*use, "kms:CreateGrant"],
            "Resource": "*",
            "Condition": {"StringEquals": {"kms:ViaService": f"{service}.{region}.amazonaws.com",
                                           "kms:CallerAccount": account_id}},
        })
    return {"Version": "2012-10-17", "Id": f"gpu-train-{purpose}", "Statement": statements}


@dataclass(frozen=True, kw_only=True)
class KeysArgs:
    prefix: str  # alias and description prefix, e.g. gpu-train-aws-dev
    account_id: str  # the account whose root administers the keys
    region: str  # for service principals and conditions
    # Service-linked roles that launch instances with volumes encrypted by the ebs key (Auto Scaling's);
    # outputs of the resources that ensure the roles exist, so the key policy is written after them.
    volume_service_roles: Sequence[pulumi.Input[str]] = field(default_factory=tuple)
    tags: Mapping[str, str] = field(default_factory=dict)  # common tags
    optional: Sequence[str] = ()  # which OPTIONAL_PURPOSES to create as well, e.g. ("rds",)


class Keys(pulumi.ComponentResource):
    def __init__(self, name: str, args: KeysArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Keys", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.keys: dict[str, aws.kms.Key] = {}
        self.arns: dict[str, pulumi.Output[str]] = {}
        unknown = sorted(set(args.optional) - set(OPTIONAL_PURPOSES))
        if unknown:
            raise ValueError(f"KeysArgs.optional lists unknown key purposes {unknown} (known: {OPTIONAL_PURPOSES})")
        for purpose in PURPOSES:
            if purpose in OPTIONAL_PURPOSES and purpose not in args.optional:
                continue
            if purpose == "ebs":
                policy = pulumi.Output.all(*args.volume_service_roles).apply(
                    lambda roles: json.dumps(key_policy("ebs", account_id=args.account_id, region=args.region,
                                                        volume_service_roles=list(roles))))
            else:
                policy = json.dumps(key_policy(purpose, account_id=args.account_id, region=args.region))
            key = aws.kms.Key(f"{name}-{purpose}", description=f"{args.prefix} {purpose} encryption",
                              enable_key_rotation=True, deletion_window_in_days=DELETION_WINDOW_DAYS,
                              policy=policy, tags={**args.tags, "purpose": purpose}, opts=child)
            aws.kms.Alias(f"{name}-{purpose}", name=f"alias/{args.prefix}-{purpose}", target_key_id=key.key_id,
                          opts=child)
            self.keys[purpose] = key
            self.arns[purpose] = key.arn
        self.register_outputs({f"{p}_key_arn": a for p, a in self.arns.items()})
