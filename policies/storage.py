"""Bucket rules: customer-managed encryption, public access blocked, TLS-only access, history kept.

Usage: `from policies import storage; list(storage.bucket_encryption_cmk(resources, ctx))` yields
`(bucket, detail)` pairs. These are stack rules because an S3 bucket's encryption, public access
block, policy, versioning and lifecycle are separate resources that point at the bucket (by name,
id or ARN).

GCS buckets carry the same settings inline (`encryption.defaultKmsKeyName`,
`publicAccessPrevention`, `versioning`, `softDeletePolicy`, `lifecycleRules`). GCS serves its JSON
and XML APIs over HTTPS only (https://cloud.google.com/storage/docs/request-endpoints), so it needs
no TLS-only policy. S3 accepts plain HTTP unless a bucket policy denies `aws:SecureTransport = false`
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/security-best-practices.html), and that deny
protects every request only when it names every principal, every S3 action and both the bucket and
its objects, with no other condition. An SSE-KMS default with no key, or with the AWS-managed key
`alias/aws/s3`, is not a customer-managed key: the account cannot restrict, rotate on its own
schedule, or revoke it (https://docs.aws.amazon.com/kms/latest/developerguide/concepts.html#aws-managed-cmk).

History: buckets that hold checkpoints or artifacts (the `purpose` tag/label the storage components
set, or the word in the bucket name) must be able to restore an overwritten or deleted object. S3 can
only do that with versioning enabled. GCS soft delete keeps deleted and overwritten objects for its
retention (https://cloud.google.com/storage/docs/soft-delete), so a GCS history bucket needs
versioning or soft delete. On any bucket, suspending S3 versioning, turning GCS soft delete off
(retention 0), or turning versioning off while lifecycle rules still manage noncurrent versions
loses history that the configuration says is kept.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator, Mapping, Sequence

from policies.core import Context, Resource, as_int, dig, is_list, items, truthy
from policies.iam import as_list, document, statements

S3_BUCKETS = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
S3_SSE = ("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
          "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2")
S3_PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
S3_ACCOUNT_PUBLIC_ACCESS_BLOCK = "aws:s3/accountPublicAccessBlock:AccountPublicAccessBlock"
S3_POLICY = "aws:s3/bucketPolicy:BucketPolicy"
S3_VERSIONING = ("aws:s3/bucketVersioning:BucketVersioning", "aws:s3/bucketVersioningV2:BucketVersioningV2")
S3_LIFECYCLE = ("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
                "aws:s3/bucketLifecycleConfigurationV2:BucketLifecycleConfigurationV2")
GCS_BUCKET = "gcp:storage/bucket:Bucket"
KMS_ALGORITHMS = ("aws:kms", "aws:kms:dsse")
BLOCK_FLAGS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
AWS_MANAGED_KEY = "alias/aws/"
HISTORY_PURPOSES = ("checkpoints", "artifacts")
# Lifecycle settings that act on noncurrent object versions (S3 rule keys, GCS condition keys).
S3_NONCURRENT = ("noncurrentVersionExpiration", "noncurrentVersionTransitions", "noncurrentVersionTransition")
GCS_NONCURRENT = ("daysSinceNoncurrentTime", "numNewerVersions", "noncurrentTimeBefore")


def _of(resources: Sequence[Resource], types: str | tuple[str, ...]) -> list[Resource]:
    types = (types,) if isinstance(types, str) else types
    return [r for r in resources if r.type in types]


def _attached(resources: Sequence[Resource], types, bucket: Resource) -> list[Resource]:
    """Companion resources (SSE config, access block, policy) whose `bucket` input is this bucket."""
    return [r for r in _of(resources, types) if bucket.referred_by(r.get("bucket"))]


def _sse_problem(rules) -> str | None:
    """None when some rule sets SSE-KMS with a customer-managed key; otherwise what is wrong."""
    problems = []
    for r in items(rules):
        default = dig(r, "applyServerSideEncryptionByDefault") or {}
        algorithm, key = dig(default, "sseAlgorithm"), dig(default, "kmsMasterKeyId")
        if algorithm not in KMS_ALGORITHMS:
            problems.append(f"sseAlgorithm is {algorithm!r}, not aws:kms")
        elif not key:
            problems.append("sseAlgorithm aws:kms has no kmsMasterKeyId, so S3 uses the AWS-managed key aws/s3")
        elif isinstance(key, str) and AWS_MANAGED_KEY in key:
            problems.append(f"kmsMasterKeyId {key!r} is the AWS-managed key, not a customer-managed one")
        else:
            return None
    return "; ".join(problems) if problems else "no server-side encryption rule"


def bucket_encryption_cmk(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Every bucket's default encryption uses a customer-managed KMS key (not aws/s3, not SSE-S3)."""
    for bucket in _of(resources, S3_BUCKETS):
        inline = bucket.get("serverSideEncryptionConfiguration", "rule")
        rule_sets = [items(inline) if is_list(inline) else [inline]] if inline else []
        rule_sets += [c.get("rules") for c in _attached(resources, S3_SSE, bucket)]
        problems = [_sse_problem(rules) for rules in rule_sets]
        if not rule_sets:
            yield bucket, "no server-side encryption configuration is attached to this bucket."
        elif all(problems):
            yield bucket, f"default encryption does not use a customer-managed KMS key: {'; '.join(problems)}."
    for bucket in _of(resources, GCS_BUCKET):
        if not bucket.get("encryption", "defaultKmsKeyName"):
            yield bucket, "encryption.defaultKmsKeyName is not set."


def bucket_public_access_blocked(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Every bucket blocks public access: all four S3 flags, or GCS public access prevention enforced."""
    account_blocks = [a for a in _of(resources, S3_ACCOUNT_PUBLIC_ACCESS_BLOCK)
                      if all(truthy(a.get(f)) for f in BLOCK_FLAGS)]
    for bucket in _of(resources, S3_BUCKETS):
        if account_blocks:
            continue
        blocks = _attached(resources, S3_PUBLIC_ACCESS_BLOCK, bucket)
        if not blocks:
            yield bucket, "no BucketPublicAccessBlock is attached to this bucket."
            continue
        missing = [f for f in BLOCK_FLAGS if not any(truthy(b.get(f)) for b in blocks)]
        if missing:
            yield bucket, f"the public access block leaves {', '.join(missing)} off."
    for bucket in _of(resources, GCS_BUCKET):
        if bucket.get("publicAccessPrevention") != "enforced":
            yield bucket, (f"publicAccessPrevention is {bucket.get('publicAccessPrevention')!r}, "
                           "not 'enforced'.")
        if not truthy(bucket.get("uniformBucketLevelAccess")):
            yield bucket, "uniformBucketLevelAccess is not true, so object ACLs can still grant access."


# --------------------------------------------------------------------------------------------
# TLS only
# --------------------------------------------------------------------------------------------


def _secure_transport_false(st: Mapping) -> bool:
    cond = st.get("Condition")
    if not isinstance(cond, Mapping):
        return False
    for op in ("Bool", "BoolIfExists"):
        values = as_list(dig(cond, op, "aws:SecureTransport"))
        if any(str(v).lower() == "false" for v in values):
            return True
    return False


def _everyone(principal) -> bool:
    if principal == "*":
        return True
    return isinstance(principal, Mapping) and "*" in as_list(principal.get("AWS"))


def _matches(patterns: list, arn: str) -> bool:
    return any(isinstance(p, str) and fnmatch.fnmatchcase(arn, p) for p in patterns)


def tls_deny_gaps(st: Mapping, bucket_name: str | None) -> list[str]:
    """What a Deny-on-aws:SecureTransport-false statement leaves unprotected ([] when nothing)."""
    gaps = []
    if "NotPrincipal" in st or not _everyone(st.get("Principal")):
        gaps.append(f"it applies only to {json.dumps(st.get('Principal', st.get('NotPrincipal')))}, not Principal '*'")
    actions = as_list(st.get("Action"))
    if "NotAction" in st or not any(a in ("*", "s3:*") for a in actions):
        gaps.append(f"it denies only {json.dumps(st.get('Action', st.get('NotAction')))}, not s3:*")
    resources = as_list(st.get("Resource"))
    name = bucket_name or "*"
    gaps += [f"it does not cover {arn}" for arn in (f"arn:aws:s3:::{name}", f"arn:aws:s3:::{name}/*")
             if "NotResource" in st or not _matches(resources, arn)]
    extra = [f"{op}:{key}" for op, keys in (st.get("Condition") or {}).items()
             for key in (keys if isinstance(keys, Mapping) else {})
             if not (op in ("Bool", "BoolIfExists") and key == "aws:SecureTransport")]
    if extra:
        gaps.append(f"it adds the conditions {', '.join(extra)}, so requests outside them are not denied")
    return gaps


def bucket_tls_only(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Every S3 bucket's policy denies every principal every S3 action over plain HTTP (GCS is HTTPS-only)."""
    for bucket in _of(resources, S3_BUCKETS):
        docs = [document(p.get("policy")) for p in _attached(resources, S3_POLICY, bucket)]
        docs.append(document(bucket.get("policy")))
        denies = [st for doc in docs for st in statements(doc)
                  if st.get("Effect") == "Deny" and _secure_transport_false(st)]
        name = bucket.get("bucket") if isinstance(bucket.get("bucket"), str) else None
        gaps = [tls_deny_gaps(st, name) for st in denies]
        if not denies:
            yield bucket, "no bucket policy denies requests where aws:SecureTransport is false."
        elif all(gaps):
            yield bucket, ("the aws:SecureTransport deny is narrowed, so some plain-HTTP requests are allowed: "
                           + "; ".join("; ".join(g) for g in gaps) + ".")


# --------------------------------------------------------------------------------------------
# History: versioning, soft delete
# --------------------------------------------------------------------------------------------


def purpose(bucket: Resource) -> str | None:
    """checkpoints | artifacts for a bucket that keeps history, from its purpose tag/label or its name."""
    tagged = str((bucket.get("tags") or bucket.get("labels") or {}).get("purpose", ""))
    if tagged in HISTORY_PURPOSES:
        return tagged
    name = str(bucket.get("bucket") or bucket.get("name") or "")
    return next((p for p in HISTORY_PURPOSES if f"-{p}-" in f"-{name}-"), None)


def _s3_status(bucket: Resource, resources: Sequence[Resource]) -> str | None:
    statuses = [dig(v.props, "versioningConfiguration", "status") for v in _attached(resources, S3_VERSIONING, bucket)]
    if truthy(bucket.get("versioning", "enabled")):
        statuses.append("Enabled")
    if "Enabled" in statuses:
        return "Enabled"
    return next((s for s in statuses if s), None)


def _s3_noncurrent(bucket: Resource, resources: Sequence[Resource]) -> bool:
    rules = [r for lc in _attached(resources, S3_LIFECYCLE, bucket) for r in items(lc.get("rules"))]
    return any(dig(r, "status") == "Enabled" and any(dig(r, k) for k in S3_NONCURRENT) for r in rules)


def _gcs_noncurrent(bucket: Resource) -> bool:
    for rule in items(bucket.get("lifecycleRules")):
        cond = dig(rule, "condition") or {}
        if any(dig(cond, k) not in (None, "", 0) for k in GCS_NONCURRENT) or dig(cond, "withState") == "ARCHIVED":
            return True
    return False


def bucket_history_kept(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Checkpoint and artifact buckets can restore overwritten or deleted objects; no bucket drops history."""
    for bucket in _of(resources, S3_BUCKETS):
        status = _s3_status(bucket, resources)
        kind = purpose(bucket)
        if status in ("Suspended", "Disabled"):
            yield bucket, f"versioning is {status}, so overwritten and deleted objects are no longer kept."
        elif kind and status != "Enabled":
            yield bucket, (f"the bucket holds {kind} but versioning is not Enabled, so an overwritten or deleted "
                           "object cannot be restored (S3 has no other undelete).")
        elif status != "Enabled" and _s3_noncurrent(bucket, resources):
            yield bucket, "lifecycle rules expire noncurrent versions but versioning is not Enabled."
    for bucket in _of(resources, GCS_BUCKET):
        versioned = truthy(bucket.get("versioning", "enabled"))
        retention = as_int(bucket.get("softDeletePolicy", "retentionDurationSeconds"))
        soft_delete = retention is None or retention > 0  # unset: the service default (7 days) applies
        if not soft_delete:
            yield bucket, ("softDeletePolicy.retentionDurationSeconds is 0, so deleted and overwritten objects "
                           "cannot be restored.")
        if not versioned and _gcs_noncurrent(bucket):
            yield bucket, ("versioning.enabled is not true although lifecycle rules manage noncurrent versions, "
                           "so no noncurrent version is kept.")
        kind = purpose(bucket)
        if kind and not versioned and not soft_delete:
            yield bucket, f"the bucket holds {kind} with neither versioning nor soft delete."

