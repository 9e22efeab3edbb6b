"""Managed database rules: RDS and Cloud SQL encrypted with a customer-managed key, never public.

Usage: `from policies import databases; list(databases.rds_encrypted_private(res, ctx))` yields one
detail string per problem (resource rules, registered in policies/registry.py).

The MLflow backend store is the platform's one managed database (infra/aws/database.py,
infra/gcp/database.py). Props are the engine's camelCase names as the offline plan records them:
- RDS (`aws:rds/instance:Instance`): `storageEncrypted`, `kmsKeyId`, `publiclyAccessible`. Without a
  `kmsKeyId`, RDS encrypts with the AWS-managed key `aws/rds`, which the account cannot rotate,
  restrict or revoke (https://docs.aws.amazon.com/AmazonRDS/latest/UserGuide/Overview.Encryption.Keys.html).
- Cloud SQL (`gcp:sql/databaseInstance:DatabaseInstance`): `encryptionKeyName` (CMEK,
  https://cloud.google.com/sql/docs/postgres/cmek), `settings.ipConfiguration.ipv4Enabled` (a public
  IPv4 address; the provider's default is true) and `settings.ipConfiguration.sslMode`
  (https://cloud.google.com/sql/docs/postgres/configure-ssl-instance#enforcing-ssl).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from policies.core import Context, Resource, dig, falsy, is_list, truthy

RDS_INSTANCE = "aws:rds/instance:Instance"
CLOUD_SQL_INSTANCE = "gcp:sql/databaseInstance:DatabaseInstance"
# Cloud SQL modes that refuse unencrypted connections; the second also requires client certificates.
SQL_TLS_MODES = ("ENCRYPTED_ONLY", "TRUSTED_CLIENT_CERTIFICATE_REQUIRED")


def rds_encrypted_private(res: Resource, ctx: Context) -> Iterator[str]:
    """RDS instances encrypt storage with a customer-managed KMS key and are not publicly accessible."""
    if res.type != RDS_INSTANCE:
        return
    if not truthy(res.get("storageEncrypted")):
        yield "storageEncrypted is not true."
    key = res.get("kmsKeyId")
    if not key:
        yield "kmsKeyId is not set, so storage would use the AWS-managed key aws/rds."
    elif isinstance(key, str) and "alias/aws/" in key:
        yield f"kmsKeyId {key!r} is an AWS-managed key, not a customer-managed one."
    if truthy(res.get("publiclyAccessible")):
        yield "publiclyAccessible is true."


def _settings(res: Resource) -> Mapping[str, Any]:
    settings = res.get("settings")
    if is_list(settings):  # a one-element list in some provider versions
        settings = settings[0] if settings else None
    return settings if isinstance(settings, Mapping) else {}


def cloud_sql_encrypted_private(res: Resource, ctx: Context) -> Iterator[str]:
    """Cloud SQL instances use CMEK, have no public IPv4 address and accept only encrypted connections."""
    if res.type != CLOUD_SQL_INSTANCE:
        return
    if not res.get("encryptionKeyName"):
        yield "encryptionKeyName is not set, so the instance uses a Google-managed key."
    ip = dig(_settings(res), "ipConfiguration", default={})
    if not falsy(dig(ip, "ipv4Enabled")):
        yield ("settings.ipConfiguration.ipv4Enabled is not false, so the instance gets a public IPv4 "
               "address (the provider's default).")
    mode = dig(ip, "sslMode")
    if mode not in SQL_TLS_MODES:
        yield f"settings.ipConfiguration.sslMode is {mode!r}; it must be ENCRYPTED_ONLY (or stricter)."
