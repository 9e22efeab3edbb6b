"""S3 buckets for datasets, checkpoints and artifacts: SSE-KMS, no public access, TLS only.

Usage:
    storage = Storage("storage", StorageArgs(prefix="gpu-train-aws-dev", account_id=..., region=..., key_arn=k, tags=t))
    storage.names["checkpoints"]  # Output[str]; storage.uris["checkpoints"] -> "s3://..."

Bucket names carry the account id and region, which makes them globally unique and stable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

PURPOSES = ("datasets", "checkpoints", "artifacts")
VERSIONED = frozenset({"checkpoints", "artifacts"})  # a bad write or delete must be recoverable
NONCURRENT_DAYS = 30
ABORT_MULTIPART_DAYS = 7


def bucket_name(prefix: str, purpose: str, account_id: str, region: str) -> str:
    """`<prefix>-<purpose>-<account>-<region>`; S3 allows 63 characters, so the prefix is shortened first."""
    suffix = f"-{purpose}-{account_id}-{region}"
    name = prefix[: 63 - len(suffix)].rstrip("-") + suffix
    if len(name) > 63 or len(name) < 3:
        raise ValueError(f"cannot make an S3 bucket name from {prefix!r} and {purpose!r}")
    return name


def tls_only_policy(bucket: str) -> dict:
    """Deny every request that does not use TLS (aws:SecureTransport false)."""
    return {
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "DenyInsecureTransport",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:*",
            "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            "Condition": {"Bool": {"aws:SecureTransport": "false"}},
        }],
    }


def lifecycle_rules(versioned: bool) -> list[dict]:
    """Abort stale multipart uploads everywhere; expire old versions where versioning is on."""
    rules = [{"id": "abort-incomplete-multipart", "status": "Enabled", "filter": {},
              "abort_incomplete_multipart_upload": {"days_after_initiation": ABORT_MULTIPART_DAYS}}]
    if versioned:
        rules.append({"id": "expire-noncurrent-versions", "status": "Enabled", "filter": {},
                      "noncurrent_version_expiration": {"noncurrent_days": NONCURRENT_DAYS}})
    return rules


@dataclass(frozen=True, kw_only=True)
class StorageArgs:
    prefix: str  # e.g. gpu-train-aws-dev
    account_id: str  # makes names globally unique
    region: str  # bucket region (also in the name)
    key_arn: pulumi.Input[str]  # the S3 KMS key
    force_destroy: bool  # dev stacks may delete non-empty buckets; prod keeps data
    tags: Mapping[str, str]  # common tags


class Storage(pulumi.ComponentResource):
    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:Storage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.names: dict[str, pulumi.Output[str]] = {}
        self.uris: dict[str, pulumi.Output[str]] = {}
        for purpose in PURPOSES:
            physical = bucket_name(args.prefix, purpose, args.account_id, args.region)
            res = f"{name}-{purpose}"
            bucket = aws.s3.Bucket(res, bucket=physical, force_destroy=args.force_destroy,
                                   tags={**args.tags, "purpose": purpose}, opts=child)
            on_bucket = pulumi.ResourceOptions(parent=bucket)
            aws.s3.BucketServerSideEncryptionConfiguration(
                res, bucket=bucket.id,
                rules=[aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                    apply_server_side_encryption_by_default=aws.s3.
                    BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs(
                        sse_algorithm="aws:kms", kms_master_key_id=args.key_arn),
                    # Bucket keys cut KMS calls (and cost) by ~99% for many small objects.
                    bucket_key_enabled=True)],
                opts=on_bucket)
            pab = aws.s3.BucketPublicAccessBlock(res, bucket=bucket.id, block_public_acls=True,
                                                 block_public_policy=True, ignore_public_acls=True,
                                                 restrict_public_buckets=True, opts=on_bucket)
            aws.s3.BucketOwnershipControls(
                res, bucket=bucket.id,
                rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
                opts=on_bucket)
            aws.s3.BucketPolicy(res, bucket=bucket.id, policy=json.dumps(tls_only_policy(physical)),
                                opts=pulumi.ResourceOptions(parent=bucket, depends_on=[pab]))
            versioned = purpose in VERSIONED
            deps = []
            if versioned:
                deps.append(aws.s3.BucketVersioning(
                    res, bucket=bucket.id,
                    versioning_configuration=aws.s3.BucketVersioningVersioningConfigurationArgs(status="Enabled"),
                    opts=on_bucket))
            aws.s3.BucketLifecycleConfiguration(res, bucket=bucket.id, rules=lifecycle_rules(versioned),
                                                opts=pulumi.ResourceOptions(parent=bucket, depends_on=deps))
            self.names[purpose] = bucket.bucket
            self.uris[purpose] = bucket.bucket.apply(lambda b: f"s3://{b}")
        self.register_outputs({"uris": self.uris})
