"""Bucket rules: customer-managed encryption, public access blocked, TLS-only access.

Usage: `from policies import storage; list(storage.bucket_encryption_cmk(resources, ctx))` yields
`(bucket, detail)` pairs. These are stack rules because an S3 bucket's encryption, public access
block and policy are separate resources that point at the bucket (by name, id or ARN).

GCS buckets carry the same settings inline (`encryption.defaultKmsKeyName`,
`publicAccessPrevention`). GCS serves its JSON and XML APIs over HTTPS only
(https://cloud.google.com/storage/docs/request-endpoints), so it needs no TLS-only policy.
S3 accepts plain HTTP unless a bucket policy denies `aws:SecureTransport = false`
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/security-best-practices.html).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from policies.core import Context, Resource, dig, is_list, items, json_value, truthy

S3_BUCKETS = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
S3_SSE = ("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
          "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2")
S3_PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
S3_ACCOUNT_PUBLIC_ACCESS_BLOCK = "aws:s3/accountPublicAccessBlock:AccountPublicAccessBlock"
S3_POLICY = "aws:s3/bucketPolicy:BucketPolicy"
GCS_BUCKET = "gcp:storage/bucket:Bucket"
KMS_ALGORITHMS = ("aws:kms", "aws:kms:dsse")
BLOCK_FLAGS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")


def _of(resources: Sequence[Resource], types: str | tuple[str, ...]) -> list[Resource]:
    types = (types,) if isinstance(types, str) else types
    return [r for r in resources if r.type in types]


def _attached(resources: Sequence[Resource], types, bucket: Resource) -> list[Resource]:
    """Companion resources (SSE config, access block, policy) whose `bucket` input is this bucket."""
    return [r for r in _of(resources, types) if bucket.referred_by(r.get("bucket"))]


def _sse_rules_use_cmk(rules) -> bool:
    return any(dig(r, "applyServerSideEncryptionByDefault", "sseAlgorithm") in KMS_ALGORITHMS
               and dig(r, "applyServerSideEncryptionByDefault", "kmsMasterKeyId") for r in items(rules))


def bucket_encryption_cmk(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Every bucket's default encryption uses a customer-managed KMS key."""
    for bucket in _of(resources, S3_BUCKETS):
        inline = bucket.get("serverSideEncryptionConfiguration", "rule")
        inline_rules = items(inline) if is_list(inline) else [inline] if inline else []
        configs = _attached(resources, S3_SSE, bucket)
        if not _sse_rules_use_cmk(inline_rules) and not any(_sse_rules_use_cmk(c.get("rules")) for c in configs):
            yield bucket, ("no server-side encryption configuration for this bucket sets sseAlgorithm aws:kms "
                           "with a kmsMasterKeyId.")
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


def _denies_insecure_transport(policy) -> bool:
    doc = json_value(policy)
    if not isinstance(doc, Mapping):
        return False
    statements = doc.get("Statement")
    statements = [statements] if isinstance(statements, Mapping) else items(statements)
    for st in statements:
        if dig(st, "Effect") != "Deny":
            continue
        condition = dig(st, "Condition", "Bool", "aws:SecureTransport")
        values = items(condition) if is_list(condition) else [condition]
        if any(str(v).lower() == "false" for v in values if v is not None):
            return True
    return False


def bucket_tls_only(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource, str]]:
    """Every S3 bucket's policy denies requests with aws:SecureTransport false (GCS is HTTPS-only)."""
    for bucket in _of(resources, S3_BUCKETS):
        policies = [p.get("policy") for p in _attached(resources, S3_POLICY, bucket)]
        policies.append(bucket.get("policy"))
        if not any(_denies_insecure_transport(p) for p in policies if p):
            yield bucket, "no bucket policy denies requests where aws:SecureTransport is false."
