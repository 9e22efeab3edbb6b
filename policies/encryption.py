"""Encryption rules: customer-managed keys for cluster secrets, disks, logs and queues; key rotation.

Usage: `from policies import encryption; list(encryption.disk_encryption_cmk(res, ctx))`; bucket
rules live in `policies/storage.py`. Every function yields one detail string per problem.

References: EKS envelope encryption (https://docs.aws.amazon.com/eks/latest/userguide/envelope-encryption.html);
GKE application-layer secrets encryption
(https://cloud.google.com/kubernetes-engine/docs/how-to/encrypting-secrets); GKE CMEK boot disks
(https://cloud.google.com/kubernetes-engine/docs/how-to/using-cmek); EBS CSI StorageClass
parameters (https://github.com/kubernetes-sigs/aws-ebs-csi-driver/blob/master/docs/parameters.md);
GCE PD CSI `disk-encryption-kms-key`
(https://github.com/kubernetes-sigs/gcp-compute-persistent-disk-csi-driver#createvolume-parameters).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from policies.core import Context, Resource, dig, items, truthy

EKS_CLUSTER = "aws:eks/cluster:Cluster"
GKE_CLUSTER = "gcp:container/cluster:Cluster"
GKE_NODE_POOL = "gcp:container/nodePool:NodePool"
EKS_NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
EC2_NODE_CLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"
EBS_VOLUME = "aws:ebs/volume:Volume"
STORAGE_CLASS = "kubernetes:storage.k8s.io/v1:StorageClass"
LOG_GROUP = "aws:cloudwatch/logGroup:LogGroup"
SQS_QUEUE = "aws:sqs/queue:Queue"
KMS_KEY = "aws:kms/key:Key"
CRYPTO_KEY = "gcp:kms/cryptoKey:CryptoKey"

EBS_CSI = "ebs.csi.aws.com"
PD_CSI = "pd.csi.storage.gke.io"
# Cloud KMS rotation periods are durations in seconds with an "s" suffix, e.g. "7776000s" (90 days).
_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?)s$")
MAX_ROTATION_DAYS = 365


def cluster_secrets_cmk(res: Resource, ctx: Context) -> Iterator[str]:
    """Kubernetes Secrets are envelope-encrypted with a customer-managed key."""
    if res.type == EKS_CLUSTER:
        config = res.get("encryptionConfig")
        configs = [config] if isinstance(config, Mapping) else items(config)  # an object in v7, a list before
        ok = any(dig(c, "provider", "keyArn") and "secrets" in items(dig(c, "resources")) for c in configs)
        if not ok:
            yield "encryptionConfig does not encrypt resources ['secrets'] with a provider.keyArn."
    elif res.type == GKE_CLUSTER:
        state = res.get("databaseEncryption", "state")
        if state != "ENCRYPTED" or not res.get("databaseEncryption", "keyName"):
            yield (f"databaseEncryption is {state or 'unset'}; it must be state ENCRYPTED with a "
                   "Cloud KMS keyName.")


def _ebs_problems(mappings, key_field: str, where: str) -> Iterator[str]:
    if not items(mappings):
        yield (f"{where} has no blockDeviceMappings, so the root volume is encrypted at best with the "
               "account default key.")
        return
    for i, m in enumerate(items(mappings)):
        ebs = dig(m, "ebs")
        if ebs is None:
            continue  # instance-store (NVMe) mappings carry no EBS settings
        if not truthy(dig(ebs, "encrypted")):
            yield f"{where} blockDeviceMappings[{i}] ({dig(m, 'deviceName')}) is not encrypted."
        elif not dig(ebs, key_field):
            yield f"{where} blockDeviceMappings[{i}] ({dig(m, 'deviceName')}) has no ebs.{key_field}."


def disk_encryption_cmk(res: Resource, ctx: Context) -> Iterator[str]:
    """Node boot disks and volumes are encrypted with a customer-managed key."""
    if res.type == LAUNCH_TEMPLATE:
        yield from _ebs_problems(res.get("blockDeviceMappings"), "kmsKeyId", "launch template")
    elif res.type == EC2_NODE_CLASS:
        yield from _ebs_problems(res.get("spec", "blockDeviceMappings"), "kmsKeyID", "spec")
    elif res.type == EBS_VOLUME:
        if not truthy(res.get("encrypted")) or not res.get("kmsKeyId"):
            yield "the volume needs encrypted true and a kmsKeyId."
    elif res.type == EKS_NODE_GROUP:
        if not res.get("launchTemplate"):
            yield ("the node group has no launchTemplate, so its disks cannot use a customer-managed key "
                   "(diskSize disks use the account default).")
    elif res.type == GKE_NODE_POOL:
        if not res.get("nodeConfig", "bootDiskKmsKey"):
            yield "nodeConfig.bootDiskKmsKey is not set."
    elif res.type == GKE_CLUSTER:
        # The default node pool exists unless removed; its disks follow the cluster's nodeConfig.
        if not truthy(res.get("removeDefaultNodePool")) and not res.get("nodeConfig", "bootDiskKmsKey"):
            yield "the default node pool is kept and nodeConfig.bootDiskKmsKey is not set."
    elif res.type == STORAGE_CLASS:
        provisioner = res.get("provisioner")
        params = res.get("parameters") or {}
        if provisioner == EBS_CSI and (not truthy(dig(params, "encrypted")) or not dig(params, "kmsKeyId")):
            yield "EBS StorageClass needs parameters encrypted: \"true\" and a kmsKeyId."
        if provisioner == PD_CSI and not dig(params, "disk-encryption-kms-key"):
            yield "PD StorageClass needs parameters disk-encryption-kms-key."


def logs_queues_cmk(res: Resource, ctx: Context) -> Iterator[str]:
    """CloudWatch log groups and SQS queues are encrypted with a KMS key."""
    if res.type == LOG_GROUP and not res.get("kmsKeyId"):
        yield "kmsKeyId is not set, so the log group uses CloudWatch's own key."
    elif res.type == SQS_QUEUE and not res.get("kmsMasterKeyId"):
        yield "kmsMasterKeyId is not set (SQS-managed SSE is not a customer-managed key)."


def kms_rotation(res: Resource, ctx: Context) -> Iterator[str]:
    """Customer-managed keys rotate: AWS enableKeyRotation, Cloud KMS rotationPeriod <= 365 days."""
    if res.type == KMS_KEY:
        symmetric = res.get("customerMasterKeySpec", default="SYMMETRIC_DEFAULT") == "SYMMETRIC_DEFAULT"
        if symmetric and not truthy(res.get("enableKeyRotation")):
            yield "enableKeyRotation is not true."
    elif res.type == CRYPTO_KEY:
        period = res.get("rotationPeriod")
        match = _DURATION.match(period) if isinstance(period, str) else None
        if match is None:
            yield f"rotationPeriod is {period!r}; set a period like '7776000s' (90 days)."
        elif float(match.group(1)) > MAX_ROTATION_DAYS * 86400:
            yield f"rotationPeriod {period} is longer than {MAX_ROTATION_DAYS} days."
