"""IAM and KMS policy documents, no mocks: `pytest tests/infra/aws/test_iam.py`."""

from __future__ import annotations

import json

import pytest

from infra.aws import iam, identities, keys

ACCOUNT, REGION = "123456789012", "us-east-1"
KEY = "arn:aws:kms:us-east-1:123456789012:key/s3"


def _actions(doc: dict) -> set[str]:
    out = set()
    for s in doc["Statement"]:
        a = s["Action"]
        out |= {a} if isinstance(a, str) else set(a)
    return out


def _resources(doc: dict) -> set[str]:
    out = set()
    for s in doc["Statement"]:
        r = s["Resource"]
        out |= {r} if isinstance(r, str) else set(r)
    return out


def test_trainer_reads_datasets_and_writes_only_its_team_prefix():
    doc = iam.trainer_policy("research", datasets_bucket="ds", checkpoints_bucket="ck", s3_key_arn=KEY)
    assert _resources(doc) == {"arn:aws:s3:::ds", "arn:aws:s3:::ds/*", "arn:aws:s3:::ck",
                               "arn:aws:s3:::ck/research/*", KEY}
    writes = [s for s in doc["Statement"] if "s3:PutObject" in s["Action"]]
    assert [w["Resource"] for w in writes] == ["arn:aws:s3:::ck/research/*"]
    listing = next(s for s in doc["Statement"] if s["Resource"] == "arn:aws:s3:::ck")
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["research/", "research/*"]}}
    kms = next(s for s in doc["Statement"] if s["Resource"] == KEY)
    assert set(kms["Action"]) == {"kms:Decrypt", "kms:GenerateDataKey"}
    # Nothing but S3 and the S3 key.
    assert {a.split(":")[0] for a in _actions(doc)} == {"s3", "kms"}
    assert not any(a.split(":")[1] == "*" for a in _actions(doc))
    with pytest.raises(ValueError, match="prefix"):
        iam.trainer_policy("a/b", datasets_bucket="ds", checkpoints_bucket="ck", s3_key_arn=KEY)


def test_cache_is_read_only_and_mlflow_only_artifacts():
    cache = iam.cache_policy(datasets_bucket="ds", s3_key_arn=KEY)
    assert not any(a.startswith(("s3:Put", "s3:Delete")) for a in _actions(cache))
    assert _resources(cache) == {"arn:aws:s3:::ds", "arn:aws:s3:::ds/*", KEY}
    ml = iam.mlflow_policy(artifacts_bucket="art", s3_key_arn=KEY)
    assert _resources(ml) == {"arn:aws:s3:::art", "arn:aws:s3:::art/*", KEY}
    assert "s3:PutObject" in _actions(ml)


def test_bindings_match_kubernetes_names():
    bs = {b.key: b for b in identities.bindings(["research", "applied"], cache=True, mlflow=True)}
    assert set(bs) == {"trainer/research", "trainer/applied", "sweeps/research", "sweeps/applied",
                       "data-prep/research", "data-prep/applied", "cache", "mlflow"}
    assert (bs["trainer/applied"].namespace, bs["trainer/applied"].service_account) == ("team-applied", "trainer")
    assert (bs["sweeps/applied"].namespace, bs["sweeps/applied"].service_account) == ("team-applied",
                                                                                        "sweep-controller")
    assert (bs["cache"].namespace, bs["cache"].service_account) == ("alluxio", "alluxio")
    assert (bs["mlflow"].namespace, bs["mlflow"].service_account) == ("mlflow", "mlflow")
    names = {"datasets": "ds", "checkpoints": "ck", "artifacts": "art", "s3_key": KEY}
    assert "arn:aws:s3:::ck/applied/*" in _resources(bs["trainer/applied"].policy(names))
    assert "arn:aws:s3:::ck/research/*" not in _resources(bs["trainer/applied"].policy(names))
    # A team's sweep controllers: its prefix of the checkpoints bucket and the key, no dataset and no other team.
    sweeps = bs["sweeps/applied"].policy(names)
    assert _resources(sweeps) == {"arn:aws:s3:::ck", "arn:aws:s3:::ck/applied/*", KEY}
    (listing,) = [st for st in sweeps["Statement"] if st["Action"] == "s3:ListBucket"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["applied/", "applied/*"]}}
    assert set(identities.bindings(["x"], cache=False, mlflow=False)[0].key.split("/")) == {"trainer", "x"}
    # A team's Ray pods preparing data: read the datasets bucket, write only its prefix of it; no checkpoints.
    assert (bs["data-prep/applied"].namespace, bs["data-prep/applied"].service_account) == ("team-applied",
                                                                                            "data-prep")
    prep = bs["data-prep/applied"].policy(names)
    assert _resources(prep) == {"arn:aws:s3:::ds", "arn:aws:s3:::ds/*", "arn:aws:s3:::ds/applied/*", KEY}
    writes = [st for st in prep["Statement"] if "s3:PutObject" in st["Action"]]
    assert [st["Resource"] for st in writes] == ["arn:aws:s3:::ds/applied/*"]
    with pytest.raises(ValueError, match="cannot scope"):
        iam.data_prep_policy("*", datasets_bucket="ds", s3_key_arn=KEY)


def test_pod_identity_trust():
    stmt = iam.pod_identity_trust(ACCOUNT)["Statement"][0]
    assert stmt["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert set(stmt["Action"]) == {"sts:AssumeRole", "sts:TagSession"}
    assert stmt["Condition"]["StringEquals"]["aws:SourceAccount"] == ACCOUNT


KARPENTER_KW = dict(cluster_name="c1", cluster_arn="arn:aws:eks:us-east-1:123456789012:cluster/c1", region=REGION,
                    account_id=ACCOUNT, node_role_arn="arn:aws:iam::123456789012:role/nodes",
                    queue_arn="arn:aws:sqs:us-east-1:123456789012:q", ebs_key_arn="arn:aws:kms:us-east-1:1:key/ebs",
                    sqs_key_arn="arn:aws:kms:us-east-1:1:key/sqs")

# The actions of Karpenter v1.14.1's reference policy (its getting-started CloudFormation template:
# NodeLifecycle, IAMIntegration, EKSIntegration, Interruption and ResourceDiscovery policies), without
# the ZonalShift policy, which serves settings.enableZonalShift (off here).
KARPENTER_1_14_ACTIONS = {
    "ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate", "ec2:CreateTags", "ec2:TerminateInstances",
    "ec2:DeleteLaunchTemplate", "ec2:DescribeCapacityReservations", "ec2:DescribeImages", "ec2:DescribeInstances",
    "ec2:DescribeInstanceStatus", "ec2:DescribeInstanceTypeOfferings", "ec2:DescribeInstanceTypes",
    "ec2:DescribeLaunchTemplates", "ec2:DescribePlacementGroups", "ec2:DescribeSecurityGroups",
    "ec2:DescribeSpotPriceHistory", "ec2:DescribeSubnets", "ssm:GetParameter", "pricing:GetProducts",
    "iam:PassRole", "iam:CreateInstanceProfile", "iam:TagInstanceProfile", "iam:AddRoleToInstanceProfile",
    "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile", "iam:ListInstanceProfiles",
    "iam:GetInstanceProfile", "eks:DescribeCluster", "sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage",
}


def test_karpenter_policy_matches_the_v1_14_reference_plus_our_keys():
    doc = iam.karpenter_controller_policy(**KARPENTER_KW)
    kms = {a for a in _actions(doc) if a.startswith("kms:")}
    assert _actions(doc) - kms == KARPENTER_1_14_ACTIONS
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    assert by_sid["PassNodeRole"]["Resource"] == KARPENTER_KW["node_role_arn"]
    assert by_sid["InterruptionQueue"]["Resource"] == KARPENTER_KW["queue_arn"]
    assert by_sid["DeleteOwned"]["Condition"]["StringEquals"] == {"aws:ResourceTag/kubernetes.io/cluster/c1": "owned"}
    assert by_sid["DescribeCluster"]["Resource"] == KARPENTER_KW["cluster_arn"]
    # Launching from an existing launch template is authorized on the template's own tags.
    lt = by_sid["LaunchFromOwnedLaunchTemplates"]
    assert lt["Resource"].endswith(":launch-template/*") and "aws:ResourceTag/karpenter.sh/nodepool" in \
        lt["Condition"]["StringLike"]
    # Capacity reservations and placement groups may be launched into.
    shared = by_sid["LaunchFromSharedResources"]["Resource"]
    assert any(r.endswith(":capacity-reservation/*") for r in shared) and any(r.endswith(":placement-group/*")
                                                                                for r in shared)
    assert by_sid["Describe"]["Condition"] == {"StringEquals": {"aws:RequestedRegion": REGION}}
    assert not any(a.endswith(":*") for a in _actions(doc))


def test_karpenter_policy_can_use_both_customer_keys():
    doc = iam.karpenter_controller_policy(**KARPENTER_KW)
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    queue_key = by_sid["InterruptionQueueKey"]
    assert queue_key["Resource"] == KARPENTER_KW["sqs_key_arn"] and queue_key["Action"] == "kms:Decrypt"
    assert queue_key["Condition"] == {"StringEquals": {"kms:ViaService": "sqs.us-east-1.amazonaws.com"}}
    use, grants = by_sid["EbsKeyUse"], by_sid["EbsKeyGrants"]
    assert use["Resource"] == grants["Resource"] == KARPENTER_KW["ebs_key_arn"]
    assert use["Condition"] == {"StringEquals": {"kms:ViaService": "ec2.us-east-1.amazonaws.com"}}
    assert grants["Action"] == "kms:CreateGrant" and grants["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}


GRANT_ACTIONS = {"kms:CreateGrant", "kms:ListGrants", "kms:RevokeGrant"}


@pytest.mark.parametrize("doc", [
    iam.karpenter_controller_policy(**KARPENTER_KW), iam.ebs_kms_policy("arn:kms:ebs"),
    *(keys.key_policy(p, account_id=ACCOUNT, region=REGION, volume_service_roles=["arn:aws:iam::1:role/x"])
      for p in keys.PURPOSES)], ids=["karpenter", "ebs-csi", *keys.PURPOSES])
def test_grant_condition_only_on_grant_actions(doc):
    # kms:GrantIsForAWSResource exists only on the grant operations; on any other action an Allow that
    # requires it can never match (https://docs.aws.amazon.com/kms/latest/developerguide/conditions-kms.html).
    for s in doc["Statement"]:
        if "kms:GrantIsForAWSResource" in json.dumps(s.get("Condition", {})):
            actions = {s["Action"]} if isinstance(s["Action"], str) else set(s["Action"])
            assert actions <= GRANT_ACTIONS, (s.get("Sid"), actions)


def test_cluster_role_may_use_the_secrets_key():
    (stmt,) = iam.cluster_encryption_policy("arn:kms:eks")["Statement"]
    assert set(stmt["Action"]) == {"kms:Encrypt", "kms:Decrypt", "kms:ListGrants", "kms:DescribeKey"}
    assert stmt["Resource"] == "arn:kms:eks"


def test_codebuild_runner_policy_is_its_own_plumbing_only():
    doc = iam.codebuild_runner_policy(region=REGION, account_id=ACCOUNT, log_group_arn="arn:lg",
                                      subnet_ids=["subnet-1"],
                                      connection_arn="arn:aws:codeconnections:us-east-1:123456789012:connection/c")
    assert {a.split(":")[0] for a in _actions(doc)} == {"ec2", "logs", "codeconnections"}
    attach = next(s for s in doc["Statement"] if s["Action"] == "ec2:CreateNetworkInterfacePermission")
    assert attach["Condition"]["ArnEquals"]["ec2:Subnet"] == [f"arn:aws:ec2:{REGION}:{ACCOUNT}:subnet/subnet-1"]
    with pytest.raises(ValueError, match="connectionArn"):
        iam.codebuild_runner_policy(region=REGION, account_id=ACCOUNT, log_group_arn="l", subnet_ids=[],
                                    connection_arn="arn:aws:iam::1:role/x")


def test_ebs_csi_kms_grants_only_for_aws_resources():
    doc = iam.ebs_kms_policy("arn:kms:ebs")
    grants = next(s for s in doc["Statement"] if "kms:CreateGrant" in s["Action"])
    assert grants["Condition"] == {"Bool": {"kms:GrantIsForAWSResource": "true"}}
    assert _resources(doc) == {"arn:kms:ebs"}


@pytest.mark.parametrize("purpose", keys.PURPOSES)
def test_every_key_policy_has_root_admin(purpose):
    doc = keys.key_policy(purpose, account_id=ACCOUNT, region=REGION)
    root = doc["Statement"][0]
    assert root["Principal"] == {"AWS": f"arn:aws:iam::{ACCOUNT}:root"} and root["Action"] == "kms:*"
    # Only root admin may use kms:* — service statements are narrower.
    assert all(s["Action"] != "kms:*" for s in doc["Statement"][1:])


def test_logs_key_requires_encryption_context_on_cryptographic_actions_only():
    stmt = keys.key_policy("logs", account_id=ACCOUNT, region=REGION)["Statement"][1]
    assert stmt["Principal"] == {"Service": f"logs.{REGION}.amazonaws.com"}
    assert stmt["Condition"]["StringLike"]["kms:EncryptionContext:aws:logs:arn"] == \
        f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:*"
    # DescribeKey carries no encryption context, so the conditioned statement could never allow it.
    assert "kms:DescribeKey" not in stmt["Action"]


def test_sqs_key_lets_eventbridge_encrypt():
    stmt = keys.key_policy("sqs", account_id=ACCOUNT, region=REGION)["Statement"][1]
    assert stmt["Principal"] == {"Service": "events.amazonaws.com"}
    assert "kms:GenerateDataKey*" in stmt["Action"]


def test_ebs_key_names_the_auto_scaling_service_linked_role():
    slr = f"arn:aws:iam::{ACCOUNT}:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"
    doc = keys.key_policy("ebs", account_id=ACCOUNT, region=REGION, volume_service_roles=[slr])
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    # Named directly: its own policy cannot grant key use, so root delegation would not reach it.
    assert by_sid["ServiceLinkedRoleUse"]["Principal"] == {"AWS": [slr]}
    grant = by_sid["ServiceLinkedRoleGrants"]
    assert grant["Principal"] == {"AWS": [slr]} and grant["Action"] == "kms:CreateGrant"
    assert grant["Condition"] == {"Bool": {"kms:GrantIsForAWSResource": "true"}}
    assert "aws:PrincipalArn" not in json.dumps(doc)
    # Without service roles the key is the account's alone.
    assert len(keys.key_policy("ebs", account_id=ACCOUNT, region=REGION)["Statement"]) == 1


def test_s3_key_only_via_s3():
    stmt = keys.key_policy("s3", account_id=ACCOUNT, region=REGION)["Statement"][1]
    assert stmt["Condition"]["StringEquals"]["kms:ViaService"] == f"s3.{REGION}.amazonaws.com"
    with pytest.raises(ValueError, match="unknown KMS key purpose"):
        keys.key_policy("dynamodb", account_id=ACCOUNT, region=REGION)
