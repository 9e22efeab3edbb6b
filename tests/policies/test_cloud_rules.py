"""Each cloud rule passes on a real plan resource and fails on a copy with one field broken.

Usage: `.venv/bin/pytest tests/policies/test_cloud_rules.py -q` (uses the session `plans` fixture).
"""

from __future__ import annotations

import json

import pytest

from policies.core import Context
from tests.policies.helpers import broken, details, first, replaced, stack_resources

DEV = Context(stack="aws-dev", environment="dev")
GDEV = Context(stack="gcp-dev", environment="dev")
PROD = Context(stack="aws-prod", environment="prod")
GPROD = Context(stack="gcp-prod", environment="prod")
CTX = {"aws-dev": DEV, "gcp-dev": GDEV, "aws-prod": PROD, "gcp-prod": GPROD}
RDS = "aws:rds/instance:Instance"
SQL = "gcp:sql/databaseInstance:DatabaseInstance"


def _set(*path, value):
    def mutate(props):
        node = props
        for step in path[:-1]:
            node = node.setdefault(step, {}) if isinstance(step, str) else node[step]
        node[path[-1]] = value
    return mutate


def _drop(*path):
    def mutate(props):
        node = props
        for step in path[:-1]:
            node = node[step]
        node.pop(path[-1], None)
    return mutate


def _is_private_subnet(r):
    return "kubernetes.io/role/elb" not in (r.props.get("tags") or {})


def _allow_firewall(r):
    return bool(r.props.get("allows")) and r.props.get("direction", "INGRESS") == "INGRESS"


# (rule, stack, type, filter, mutation, words the detail must name)
RESOURCE_CASES = [
    ("no-public-node-ips", "aws-dev", "aws:ec2/launchTemplate:LaunchTemplate", None,
     _set("networkInterfaces", value=[{"associatePublicIpAddress": "true", "deviceIndex": 0}]),
     "associatePublicIpAddress"),
    ("no-public-node-ips", "aws-dev", "aws:ec2/subnet:Subnet", _is_private_subnet,
     _set("mapPublicIpOnLaunch", value=True), "mapPublicIpOnLaunch"),
    ("no-public-node-ips", "aws-dev", "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass", None,
     _set("spec", "associatePublicIPAddress", value=True), "associatePublicIPAddress"),
    ("no-public-node-ips", "gcp-dev", "gcp:container/nodePool:NodePool", None,
     _set("networkConfig", "enablePrivateNodes", value=False), "enablePrivateNodes"),
    ("no-open-ingress", "aws-dev", "aws:ec2/securityGroup:SecurityGroup", None,
     _set("ingress", value=[{"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": ["0.0.0.0/0"]}]),
     "0.0.0.0/0"),
    ("no-open-ingress", "aws-prod", "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", None,
     _set("cidrIpv6", value="::/0"), "::/0"),
    ("no-open-ingress", "gcp-prod", "gcp:compute/firewall:Firewall", _allow_firewall,
     _set("sourceRanges", value=["10.0.0.0/8", "0.0.0.0/0"]), "0.0.0.0/0"),
    ("eks-endpoint-restricted", "aws-prod", "aws:eks/cluster:Cluster", None,
     _set("vpcConfig", "publicAccessCidrs", value=["0.0.0.0/0"]), "publicAccessCidrs"),
    ("eks-endpoint-restricted", "aws-dev", "aws:eks/cluster:Cluster", None,
     _set("vpcConfig", "endpointPublicAccess", value=True), "publicAccessCidrs"),
    ("gke-private-cluster", "gcp-prod", "gcp:container/cluster:Cluster", None,
     _drop("masterAuthorizedNetworksConfig"), "masterAuthorizedNetworksConfig"),
    ("gke-private-cluster", "gcp-dev", "gcp:container/cluster:Cluster", None,
     _set("privateClusterConfig", "enablePrivateNodes", value=False), "enablePrivateNodes"),
    ("cluster-secrets-cmk", "aws-dev", "aws:eks/cluster:Cluster", None, _drop("encryptionConfig"), "secrets"),
    ("cluster-secrets-cmk", "gcp-dev", "gcp:container/cluster:Cluster", None,
     _set("databaseEncryption", "state", value="DECRYPTED"), "DECRYPTED"),
    ("disk-encryption-cmk", "aws-prod", "aws:ec2/launchTemplate:LaunchTemplate", None,
     _set("blockDeviceMappings", 0, "ebs", "encrypted", value="false"), "not encrypted"),
    ("disk-encryption-cmk", "aws-dev", "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass", None,
     _drop("spec", "blockDeviceMappings"), "blockDeviceMappings"),
    ("disk-encryption-cmk", "aws-dev", "aws:eks/nodeGroup:NodeGroup", None, _drop("launchTemplate"),
     "launchTemplate"),
    ("disk-encryption-cmk", "gcp-dev", "gcp:container/nodePool:NodePool", None,
     _drop("nodeConfig", "bootDiskKmsKey"), "bootDiskKmsKey"),
    ("logs-queues-cmk", "aws-dev", "aws:cloudwatch/logGroup:LogGroup", None, _drop("kmsKeyId"), "kmsKeyId"),
    ("logs-queues-cmk", "aws-dev", "aws:sqs/queue:Queue", None, _drop("kmsMasterKeyId"), "kmsMasterKeyId"),
    ("kms-rotation", "aws-dev", "aws:kms/key:Key", None, _set("enableKeyRotation", value=False),
     "enableKeyRotation"),
    ("kms-rotation", "gcp-dev", "gcp:kms/cryptoKey:CryptoKey", None, _set("rotationPeriod", value="63072000s"),
     "longer than 365 days"),
    ("imdsv2-required", "aws-prod", "aws:ec2/launchTemplate:LaunchTemplate", None,
     _set("metadataOptions", "httpTokens", value="optional"), "httpTokens"),
    ("imdsv2-required", "aws-dev", "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass", None,
     _set("spec", "metadataOptions", "httpTokens", value="optional"), "httpTokens"),
    ("imdsv2-required", "gcp-prod", "gcp:container/nodePool:NodePool", None,
     _set("nodeConfig", "workloadMetadataConfig", "mode", value="GCE_METADATA"), "GKE_METADATA"),
    ("registry-immutable-scanned", "aws-dev", "aws:ecr/repository:Repository", None,
     _set("imageTagMutability", value="MUTABLE"), "IMMUTABLE"),
    ("registry-immutable-scanned", "aws-prod", "aws:ecr/repository:Repository", None,
     _set("imageScanningConfiguration", "scanOnPush", value=False), "scanOnPush"),
    ("registry-immutable-scanned", "gcp-dev", "gcp:artifactregistry/repository:Repository", None,
     _set("dockerConfig", "immutableTags", value=False), "immutableTags"),
    ("required-tags", "aws-dev", "aws:s3/bucket:Bucket", None, _drop("tags", "stack"), "stack"),
    ("required-tags", "aws-prod", "aws:eks/nodeGroup:NodeGroup", None, _drop("tags", "managed-by"), "managed-by"),
    ("required-tags", "gcp-dev", "gcp:storage/bucket:Bucket", None, _drop("labels", "environment"),
     "environment"),
    ("required-tags", "gcp-prod", "gcp:container/cluster:Cluster", None, _drop("resourceLabels"), "project"),
    ("required-tags", "aws-dev", "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass", None,
     _drop("spec", "tags", "project"), "spec.tags"),
    ("rds-encrypted-private", "aws-prod", RDS, None, _set("storageEncrypted", value=False), "storageEncrypted"),
    ("rds-encrypted-private", "aws-prod", RDS, None, _drop("kmsKeyId"), "kmsKeyId"),
    ("rds-encrypted-private", "aws-prod", RDS, None,
     _set("kmsKeyId", value="arn:aws:kms:us-east-1:123456789012:alias/aws/rds"), "AWS-managed"),
    ("rds-encrypted-private", "aws-prod", RDS, None, _set("publiclyAccessible", value=True), "publiclyAccessible"),
    ("cloud-sql-encrypted-private", "gcp-prod", SQL, None, _drop("encryptionKeyName"), "encryptionKeyName"),
    ("cloud-sql-encrypted-private", "gcp-prod", SQL, None, _set("settings", "ipConfiguration", "ipv4Enabled",
                                                                value=True), "ipv4Enabled"),
    ("cloud-sql-encrypted-private", "gcp-prod", SQL, None, _drop("settings", "ipConfiguration", "ipv4Enabled"),
     "ipv4Enabled"),
    ("cloud-sql-encrypted-private", "gcp-prod", SQL, None, _set("settings", "ipConfiguration", "sslMode",
                                                                value="ALLOW_UNENCRYPTED_AND_ENCRYPTED"), "sslMode"),
    ("allowed-regions", "gcp-dev", "gcp:container/cluster:Cluster", None, _set("location", value="asia-east1-a"),
     "asia-east1-a"),
    ("allowed-regions", "gcp-prod", "gcp:storage/bucket:Bucket", None, _set("location", value="EU"), "EU"),
]


@pytest.mark.parametrize(("rule_id", "stack", "typ", "where", "mutate", "word"), RESOURCE_CASES,
                         ids=[f"{c[0]}-{c[2].split(':')[-1]}-{c[1]}" for c in RESOURCE_CASES])
def test_resource_rule_passes_real_and_fails_broken(plans, rule_id, stack, typ, where, mutate, word):
    real = first(plans, stack, typ, where or (lambda r: True))
    assert details(rule_id, [real], CTX[stack]) == []
    bad = details(rule_id, [broken(real, mutate)], CTX[stack])
    assert bad and any(word in d for d in bad), bad


def test_untaggable_types_are_never_flagged(plans):
    for stack in plans:
        for res in stack_resources(plans, stack):
            if res.type.startswith(("aws:iam/rolePolicyAttachment", "gcp:compute/firewall", "aws:kms/alias",
                                    "pulumi:providers:", "gpu-train:")):
                stripped = broken(res, lambda p: [p.pop(k, None) for k in ("tags", "labels")])
                assert details("required-tags", [stripped], CTX[stack]) == []


def test_firewall_deny_from_anywhere_is_allowed(plans):
    fw = first(plans, "gcp-prod", "gcp:compute/firewall:Firewall", _allow_firewall)
    deny = broken(fw, lambda p: p.update(allows=[], denies=[{"protocol": "all"}], sourceRanges=["0.0.0.0/0"]))
    assert details("no-open-ingress", [deny], GPROD) == []


# ---- stack rules: the whole real plan passes; one resource broken makes it fail -------------

def _break_in_stack(plans, stack, typ, mutate, where=lambda r: True):
    resources = stack_resources(plans, stack)
    target = next(r for r in resources if r.type == typ and where(r))
    return resources, replaced(resources, target, broken(target, mutate)), target


def _sse_aes256(props):
    props["rules"][0]["applyServerSideEncryptionByDefault"] = {"sseAlgorithm": "AES256"}


def _policy_without_tls_deny(props):
    doc = json.loads(props["policy"]) if isinstance(props["policy"], str) else props["policy"]
    doc["Statement"] = [s for s in doc["Statement"]
                        if "aws:SecureTransport" not in json.dumps(s.get("Condition", {}))]
    props["policy"] = json.dumps(doc)


STACK_CASES = [
    ("bucket-encryption-cmk", "aws-dev",
     "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration", _sse_aes256,
     "aws:kms"),
    ("bucket-encryption-cmk", "gcp-prod", "gcp:storage/bucket:Bucket", _drop("encryption"), "defaultKmsKeyName"),
    ("bucket-public-access-blocked", "aws-prod", "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock",
     _set("restrictPublicBuckets", value=False), "restrictPublicBuckets"),
    ("bucket-public-access-blocked", "aws-dev", "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock",
     _set("bucket", value="some-other-bucket"), "BucketPublicAccessBlock"),
    ("bucket-public-access-blocked", "gcp-dev", "gcp:storage/bucket:Bucket",
     _set("publicAccessPrevention", value="inherited"), "enforced"),
    ("bucket-tls-only", "aws-dev", "aws:s3/bucketPolicy:BucketPolicy", _policy_without_tls_deny,
     "SecureTransport"),
    ("spot-interruption-handling", "aws-dev", "kubernetes:helm.sh/v3:Release",
     _set("values", "settings", "interruptionQueue", value="another-queue"), "interruptionQueue"),
    ("spot-interruption-handling", "aws-dev", "aws:cloudwatch/eventRule:EventRule",
     _set("eventPattern", value=json.dumps({"source": ["aws.ec2"], "detail-type": ["Something else"]})),
     "Spot Instance Interruption Warning"),
    ("gpu-scale-to-zero", "gcp-dev", "gcp:container/nodePool:NodePool",
     _set("autoscaling", "totalMinNodeCount", value=1), "1 GPU node"),
    ("gpu-total-cap", "aws-dev", "kubernetes:karpenter.sh/v1:NodePool", _drop("spec", "limits"), "unbounded"),
    ("gpu-total-cap", "gcp-prod", "gcp:container/nodePool:NodePool",
     _set("autoscaling", "totalMaxNodeCount", value=40), "more than the 64"),
]


def _gpu_pool(r):
    cfg = r.props.get("nodeConfig") or {}
    return bool(cfg.get("guestAccelerators")) or r.type != "gcp:container/nodePool:NodePool"


def _spot_rule(r):
    return r.type != "aws:cloudwatch/eventRule:EventRule" or "Spot Instance" in r.props.get("eventPattern", "")


def _karpenter(r):
    return r.type != "kubernetes:helm.sh/v3:Release" or "karpenter" in r.props.get("chart", "")


@pytest.mark.parametrize(("rule_id", "stack", "typ", "mutate", "word"), STACK_CASES,
                         ids=[f"{c[0]}-{c[2].split(':')[-1]}-{c[1]}" for c in STACK_CASES])
def test_stack_rule_passes_real_and_fails_broken(plans, rule_id, stack, typ, mutate, word):
    ctx = Context(stack=stack, environment=CTX[stack].environment, max_gpus=64)
    resources, bad, _ = _break_in_stack(
        plans, stack, typ, mutate, lambda r: _gpu_pool(r) and _spot_rule(r) and _karpenter(r))
    assert details(rule_id, resources, ctx) == []
    found = details(rule_id, bad, ctx)
    assert found and any(word in d for d in found), found


def test_prod_keeps_reserved_gpu_nodes_but_the_same_pools_fail_in_dev(plans):
    resources = stack_resources(plans, "aws-prod")
    assert details("gpu-scale-to-zero", resources, PROD) == []
    found = details("gpu-scale-to-zero", resources, Context(stack="aws-prod", environment="dev"))
    assert found and all("GPU node" in d for d in found)


def test_gpu_cap_counts_every_pool(plans):
    resources = stack_resources(plans, "aws-dev")
    # aws-dev's Karpenter pools are limited to 4 + 2 GPUs: a cap of 5 must trip, 6 must not.
    assert details("gpu-total-cap", resources, Context(stack="aws-dev", max_gpus=6)) == []
    over = details("gpu-total-cap", resources, Context(stack="aws-dev", max_gpus=5))
    assert len(over) == 1 and "6 GPUs" in over[0]
