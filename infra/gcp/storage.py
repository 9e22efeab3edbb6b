"""Cloud Storage buckets for datasets, checkpoints and artifacts, encrypted with our key.

Usage (inside the Pulumi program; `build_platform` does this):
    storage = Storage("storage", StorageArgs(stack=cfg.stack, project=cfg.project, region=cfg.region,
                                             environment=cfg.environment, protect=cfg.is_prod, labels=tags,
                                             kms_key=keys.key_ids["storage"]),
                      opts=ResourceOptions(depends_on=[keys.grants["storage"]]))
    storage.buckets["checkpoints"].name ; storage.uris["datasets"] -> gs://...

`bucket_name(...)` and `lifecycle_rules(purpose, environment)` are pure and tested without mocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from gpu_train.spec import naming

PURPOSES = ("datasets", "checkpoints", "artifacts")
# Deleted objects stay restorable this long (GCS soft delete; 7 days is the service default and
# the minimum non-zero value: https://cloud.google.com/storage/docs/soft-delete).
SOFT_DELETE_SECONDS = 7 * 24 * 3600
# Checkpoints are overwritten in place (latest pointer, manifests); old versions are kept this
# many days so a bad overwrite can be rolled back, then deleted.
NONCURRENT_DAYS = {"dev": 3, "staging": 7, "prod": 14}
# Parts of an interrupted multipart (XML API) upload are billed until aborted.
ABORT_MULTIPART_DAYS = 1


def bucket_name(stack: str, purpose: str, project: str) -> str:
    """Globally unique bucket name: the stack prefix, the purpose and the project id."""
    return naming.resource_name(stack, purpose, project)


def lifecycle_rules(purpose: str, environment: str) -> list[dict]:
    """Lifecycle rules as plain dicts (action, condition) for one bucket."""
    rules = [{"action": {"type": "AbortIncompleteMultipartUpload"},
              "condition": {"age": ABORT_MULTIPART_DAYS}}]
    if purpose == "checkpoints":
        rules.append({"action": {"type": "Delete"},
                      "condition": {"days_since_noncurrent_time": NONCURRENT_DAYS[environment],
                                    "with_state": "ARCHIVED"}})
    return rules


@dataclass(frozen=True, kw_only=True)
class StorageArgs:
    stack: str  # the Pulumi stack name (part of every bucket name)
    project: str  # GCP project id (also makes the bucket names globally unique)
    region: str  # the buckets' location
    environment: str  # dev | staging | prod: how long old checkpoint versions stay (NONCURRENT_DAYS)
    protect: bool  # prod: buckets are protected and never emptied by `pulumi destroy`
    labels: dict[str, str]  # common labels for every bucket
    kms_key: pulumi.Input[str]  # default CMEK for every object written


class Storage(pulumi.ComponentResource):
    """Three private, CMEK-encrypted, uniformly-accessed buckets."""

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:gcp:Storage", name, None, opts)
        self.buckets: dict[str, gcp.storage.Bucket] = {}
        for purpose in PURPOSES:
            self.buckets[purpose] = gcp.storage.Bucket(
                f"{name}-{purpose}", name=bucket_name(args.stack, purpose, args.project), project=args.project,
                location=args.region.upper(), storage_class="STANDARD",
                uniform_bucket_level_access=True, public_access_prevention="enforced",
                encryption=gcp.storage.BucketEncryptionArgs(default_kms_key_name=args.kms_key),
                soft_delete_policy=gcp.storage.BucketSoftDeletePolicyArgs(
                    retention_duration_seconds=SOFT_DELETE_SECONDS),
                versioning=gcp.storage.BucketVersioningArgs(enabled=purpose == "checkpoints"),
                lifecycle_rules=[
                    gcp.storage.BucketLifecycleRuleArgs(
                        action=gcp.storage.BucketLifecycleRuleActionArgs(**rule["action"]),
                        condition=gcp.storage.BucketLifecycleRuleConditionArgs(**rule["condition"]))
                    for rule in lifecycle_rules(purpose, args.environment)],
                # Dev buckets may be emptied by `pulumi destroy`; prod buckets must be emptied by hand.
                force_destroy=not args.protect,
                labels={**args.labels, "purpose": purpose},
                opts=pulumi.ResourceOptions(parent=self, protect=args.protect))
        self.uris = {p: pulumi.Output.concat("gs://", b.name) for p, b in self.buckets.items()}
        self.register_outputs({"uris": self.uris})
