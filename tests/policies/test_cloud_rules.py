"""Each cloud rule passes on a real plan resource and fails on a copy with one field broken.

Usage: `.venv/bin/pytest tests/policies/test_cloud_rules.py -q` (uses the session `plans` fixture).
"""

from __future__ import annotations

import json

import pytest

from policies.core import Context, Resource
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


def _immutable(r):
    return r.props.get("imageTagMutability") == "IMMUTABLE" or (r.props.get("dockerConfig") or {}).get("immutableTags")


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
     lambda p: (_set("privateClusterConfig", "enablePrivateEndpoint", value=False)(p),
                _drop("masterAuthorizedNetworksConfig")(p)), "masterAuthorizedNetworksConfig"),
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
    ("registry-immutable-scanned", "aws-dev", "aws:ecr/repository:Repository", _immutable,
     _set("imageTagMutability", value="MUTABLE"), "IMMUTABLE"),
    ("registry-immutable-scanned", "aws-dev", "aws:ecr/repository:Repository", _immutable,
     _set("imageTagMutability", value="IMMUTABLE_WITH_EXCLUSION"), "IMMUTABLE_WITH_EXCLUSION"),
    ("registry-immutable-scanned", "aws-prod", "aws:ecr/repository:Repository", None,
     _set("imageScanningConfiguration", "scanOnPush", value=False), "scanOnPush"),
    ("registry-immutable-scanned", "gcp-dev", "gcp:artifactregistry/repository:Repository", _immutable,
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
    return r.type != "kubernetes:helm.sh/v3:Release" or r.props.get("chart", "").rstrip("/").endswith("/karpenter")


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


# ---- rules added for the security review: each passes on every real plan and fails broken -----

HALVES = ["0.0.0.0/1", "128.0.0.0/1"]


def _has_ingress(r):
    return bool(r.props.get("ingress"))


def _node_group_subnet(resources):
    """A subnet some node group launches nodes in, found by reference (not by name)."""
    refs = {s for r in resources if r.type == "aws:eks/nodeGroup:NodeGroup" for s in r.props.get("subnetIds", [])}
    return lambda r: any(r.referred_by(ref) for ref in refs)


def _add_statement(statement):
    def mutate(props):
        doc = json.loads(props["policy"])
        doc["Statement"].append(statement)
        props["policy"] = json.dumps(doc)
    return mutate


def _edit_tls_deny(**changes):
    def mutate(props):
        doc = json.loads(props["policy"])
        for st in doc["Statement"]:
            if "aws:SecureTransport" in json.dumps(st.get("Condition", {})):
                st.update(changes)
        props["policy"] = json.dumps(doc)
    return mutate


def _versioned(r):
    return (r.props.get("versioning") or {}).get("enabled") is True or r.type.startswith("aws:s3/bucketVersioning")


def _gpu_node_pool(r):
    return bool((r.props.get("nodeConfig") or {}).get("guestAccelerators"))


# (rule, stack, type, filter or None, mutation, word the detail must name)
NEW_CASES = [
    ("no-open-ingress", "aws-prod", "aws:ec2/securityGroup:SecurityGroup", _has_ingress,
     lambda p: p["ingress"][0].update(cidrBlocks=HALVES), "every public IPv4 address"),
    ("no-open-ingress", "aws-dev", "aws:ec2/securityGroup:SecurityGroup", _has_ingress,
     lambda p: p["ingress"][0].update(ipv6CidrBlocks=["0::/0"]), "every public IPv6 address"),
    ("no-open-ingress", "aws-dev", "aws:ec2/securityGroup:SecurityGroup", _has_ingress,
     lambda p: p["ingress"].extend([{**p["ingress"][0], "cidrBlocks": [c]} for c in HALVES]), "joined with"),
    ("eks-endpoint-restricted", "aws-prod", "aws:eks/cluster:Cluster", None,
     _set("vpcConfig", "publicAccessCidrs", value=HALVES), "every public IPv4 address"),
    ("gke-private-cluster", "gcp-dev", "gcp:container/cluster:Cluster", None,
     _set("masterAuthorizedNetworksConfig", "cidrBlocks", value=[{"cidrBlock": c} for c in HALVES]),
     "every public IPv4 address"),
    ("imdsv2-required", "aws-dev", "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass", None,
     _set("spec", "metadataOptions", "httpPutResponseHopLimit", value=3), "httpPutResponseHopLimit is 3"),
    ("imdsv2-required", "aws-prod", "aws:ec2/launchTemplate:LaunchTemplate", None,
     _drop("metadataOptions", "httpPutResponseHopLimit"), "not set"),
    ("imdsv2-required", "gcp-prod", "gcp:container/nodePool:NodePool", None,
     _set("nodeConfig", "metadata", value={"disable-legacy-endpoints": "false"}), "legacy"),
    ("control-plane-audit-logs", "aws-prod", "aws:eks/cluster:Cluster", None,
     _set("enabledClusterLogTypes", value=["api"]), "audit"),
    ("control-plane-audit-logs", "gcp-dev", "gcp:container/cluster:Cluster", None,
     _set("loggingService", value="none"), "none"),
    ("control-plane-audit-logs", "gcp-prod", "gcp:container/cluster:Cluster", None,
     _set("loggingConfig", "enableComponents", value=[]), "SYSTEM_COMPONENTS"),
    ("allowed-regions", "aws-dev", "aws:ec2/subnet:Subnet", None,
     _set("availabilityZone", value="ap-south-1a"), "ap-south-1"),
    ("allowed-regions", "aws-prod", "aws:ec2/vpcEndpoint:VpcEndpoint", None,
     _set("serviceName", value="com.amazonaws.sa-east-1.s3"), "sa-east-1"),
    ("allowed-regions", "aws-prod", "aws:eks/cluster:Cluster", None,
     _set("encryptionConfig", "provider", "keyArn", value="arn:aws:kms:eu-central-1:123456789012:key/k"),
     "eu-central-1"),
    ("no-public-resource-policy", "aws-dev", "aws:kms/key:Key", None,
     _add_statement({"Effect": "Allow", "Principal": "*", "Action": "kms:*", "Resource": "*"}), "kms:*"),
    ("no-public-resource-policy", "gcp-dev", "gcp:storage/bucketIAMMember:BucketIAMMember", None,
     _set("member", value="allUsers"), "allUsers"),
    ("no-wildcard-iam", "aws-prod", "aws:iam/rolePolicy:RolePolicy", None,
     _add_statement({"Effect": "Allow", "Action": "*", "Resource": "*"}), "Resource '*'"),
    ("no-wildcard-iam", "gcp-prod", "gcp:projects/iAMMember:IAMMember", None, _set("role", value="roles/owner"),
     "roles/owner"),
]


@pytest.mark.parametrize(("rule_id", "stack", "typ", "where", "mutate", "word"), NEW_CASES,
                         ids=[f"{c[0]}-{c[2].split(':')[-1]}-{c[1]}" for c in NEW_CASES])
def test_new_resource_rules_pass_real_and_fail_broken(plans, rule_id, stack, typ, where, mutate, word):
    resources = stack_resources(plans, stack)
    target = next(r for r in resources if r.type == typ and (where or (lambda r: True))(r))
    assert details(rule_id, resources, CTX[stack]) == []
    bad = details(rule_id, replaced(resources, target, broken(target, mutate)), CTX[stack])
    assert bad and any(word in d for d in bad), bad


NEW_STACK_CASES = [
    ("no-public-node-ips", "aws-dev", "aws:ec2/subnet:Subnet", _node_group_subnet,
     lambda p: p.update(mapPublicIpOnLaunch=True, tags={**p["tags"], "kubernetes.io/role/elb": "1"}),
     "node subnet"),
    ("bucket-encryption-cmk", "aws-prod",
     "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration", None,
     lambda p: p["rules"][0]["applyServerSideEncryptionByDefault"].update(kmsMasterKeyId="alias/aws/s3"),
     "AWS-managed"),
    ("bucket-tls-only", "aws-dev", "aws:s3/bucketPolicy:BucketPolicy", None, _edit_tls_deny(Action="s3:GetObject"),
     "not s3:*"),
    ("bucket-tls-only", "aws-prod", "aws:s3/bucketPolicy:BucketPolicy", None,
     _edit_tls_deny(Principal={"AWS": "arn:aws:iam::123456789012:root"}), "not Principal '*'"),
    ("bucket-history-kept", "aws-dev", "aws:s3/bucketVersioning:BucketVersioning", None,
     _set("versioningConfiguration", "status", value="Suspended"), "Suspended"),
    ("bucket-history-kept", "gcp-prod", "gcp:storage/bucket:Bucket", lambda rs: _versioned,
     _set("versioning", "enabled", value=False), "noncurrent"),
    ("bucket-history-kept", "gcp-dev", "gcp:storage/bucket:Bucket", None,
     _set("softDeletePolicy", "retentionDurationSeconds", value=0), "softDeletePolicy"),
]


@pytest.mark.parametrize(("rule_id", "stack", "typ", "where", "mutate", "word"), NEW_STACK_CASES,
                         ids=[f"{c[0]}-{c[2].split(':')[-1]}-{c[1]}" for c in NEW_STACK_CASES])
def test_new_stack_rules_pass_real_and_fail_broken(plans, rule_id, stack, typ, where, mutate, word):
    resources = stack_resources(plans, stack)
    pick = where(resources) if where else (lambda r: True)
    target = next(r for r in resources if r.type == typ and pick(r))
    assert details(rule_id, resources, CTX[stack]) == []
    bad = details(rule_id, replaced(resources, target, broken(target, mutate)), CTX[stack])
    assert bad and any(word in d for d in bad), bad


def test_a_build_cache_may_be_mutable_only_while_no_workload_runs_from_it(plans):
    jobset = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
    for stack in ("aws-dev", "gcp-prod"):
        resources = stack_resources(plans, stack)
        assert details("registry-immutable-scanned", resources, CTX[stack]) == []
        repo = next(r for r in resources if r.type in ("aws:ecr/repository:Repository",
                                                        "gcp:artifactregistry/repository:Repository")
                    and _immutable(r))
        cache = broken(repo, lambda p: p.update(
            imageTagMutability="MUTABLE", dockerConfig={"immutableTags": False},
            **{k: {**p[k], "purpose": "build-cache"} for k in ("tags", "labels") if k in p}))
        # The training JobSet runs its image from this repository, so a mutable tag there is flagged.
        found = details("registry-immutable-scanned", replaced(resources, repo, cache), CTX[stack])
        assert found and "from it" in found[0], found
        # Once nothing runs from it, a repository labelled as a build cache may be mutable...
        job = next(r for r in resources if r.type == jobset)
        elsewhere = broken(job, lambda p: [c.update(image="registry.example/other/trainer@sha256:" + "0" * 64)
                                           for rj in p["spec"]["replicatedJobs"]
                                           for c in rj["template"]["spec"]["template"]["spec"]["containers"]])
        moved = replaced(resources, job, elsewhere)
        assert details("registry-immutable-scanned", replaced(moved, repo, cache), CTX[stack]) == []
        # ...and one without that label may not.
        unlabelled = broken(cache, lambda p: [p[k].pop("purpose") for k in ("tags", "labels") if k in p])
        assert details("registry-immutable-scanned", replaced(moved, repo, unlabelled), CTX[stack])


def test_static_karpenter_pools_are_bounded_by_replicas():
    """A static NodePool keeps spec.replicas nodes; p5.48xlarge has 8 H100s (EC2 accelerated instances)."""
    pool = Resource(type="kubernetes:karpenter.sh/v1:NodePool", name="static", urn="urn:static", props={"spec": {
        "replicas": 2, "limits": {"nodes": "2"}, "template": {"spec": {"requirements": [
            {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5.48xlarge"]}]}}}})
    assert details("gpu-total-cap", [pool], Context(stack="aws-prod", max_gpus=16)) == []
    over = details("gpu-total-cap", [pool], Context(stack="aws-prod", max_gpus=15))
    assert len(over) == 1 and "16 GPUs" in over[0]
    unbounded = broken(pool, lambda p: [p["spec"].pop("replicas"), p["spec"].pop("limits")])
    assert any("unbounded" in d for d in details("gpu-total-cap", [unbounded], Context(stack="aws-prod")))
