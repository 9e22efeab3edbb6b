"""IAM and KMS policy documents, no mocks: `pytest tests/infra/aws/test_iam.py`."""

from __future__ import annotations

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
    assert set(bs) == {"trainer/research", "trainer/applied", "cache", "mlflow"}
    assert (bs["trainer/applied"].namespace, bs["trainer/applied"].service_account) == ("team-applied", "trainer")
    assert (bs["cache"].namespace, bs["cache"].service_account) == ("alluxio", "alluxio")
    assert (bs["mlflow"].namespace, bs["mlflow"].service_account) == ("mlflow", "mlflow")
    names = {"datasets": "ds", "checkpoints": "ck", "artifacts": "art", "s3_key": KEY}
    assert "arn:aws:s3:::ck/applied/*" in _resources(bs["trainer/applied"].policy(names))
    assert "arn:aws:s3:::ck/research/*" not in _resources(bs["trainer/applied"].policy(names))
    assert set(identities.bindings(["x"], cache=False, mlflow=False)[0].key.split("/")) == {"trainer", "x"}


def test_pod_identity_trust():
    stmt = iam.pod_identity_trust(ACCOUNT)["Statement"][0]
    assert stmt["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert set(stmt["Action"]) == {"sts:AssumeRole", "sts:TagSession"}
    assert stmt["Condition"]["StringEquals"]["aws:SourceAccount"] == ACCOUNT


def test_karpenter_policy_is_scoped_to_cluster_queue_and_role():
    doc = iam.karpenter_controller_policy(cluster_name="c1", cluster_arn="arn:eks:c1", region=REGION,
                                          account_id=ACCOUNT, node_role_arn="arn:role/nodes", queue_arn="arn:sqs:q",
                                          ebs_key_arn="arn:kms:ebs")
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    assert by_sid["PassNodeRole"]["Resource"] == "arn:role/nodes"
    assert by_sid["InterruptionQueue"]["Resource"] == "arn:sqs:q"
    assert by_sid["DeleteOwned"]["Condition"]["StringEquals"] == {"aws:ResourceTag/kubernetes.io/cluster/c1": "owned"}
    assert by_sid["DescribeCluster"]["Resource"] == "arn:eks:c1"
    # No statement grants a whole service.
    assert not any(a.endswith(":*") for a in _actions(doc))


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


def test_logs_key_requires_encryption_context():
    stmt = keys.key_policy("logs", account_id=ACCOUNT, region=REGION)["Statement"][1]
    assert stmt["Principal"] == {"Service": f"logs.{REGION}.amazonaws.com"}
    assert stmt["Condition"]["ArnLike"]["kms:EncryptionContext:aws:logs:arn"].startswith(
        f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:")


def test_sqs_key_lets_eventbridge_encrypt():
    stmt = keys.key_policy("sqs", account_id=ACCOUNT, region=REGION)["Statement"][1]
    assert stmt["Principal"] == {"Service": "events.amazonaws.com"}
    assert "kms:GenerateDataKey*" in stmt["Action"]


def test_ebs_key_grants_autoscaling_and_listed_roles():
    doc = keys.key_policy("ebs", account_id=ACCOUNT, region=REGION, ebs_user_role_arns=["arn:role/karpenter"])
    grant = next(s for s in doc["Statement"] if s["Action"] == "kms:CreateGrant")
    principals = grant["Condition"]["ArnEquals"]["aws:PrincipalArn"]
    assert any(p.endswith("AWSServiceRoleForAutoScaling") for p in principals)
    assert "arn:role/karpenter" in principals
    assert grant["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}


def test_s3_key_only_via_s3():
    stmt = keys.key_policy("s3", account_id=ACCOUNT, region=REGION)["Statement"][1]
    assert stmt["Condition"]["StringEquals"]["kms:ViaService"] == f"s3.{REGION}.amazonaws.com"
    with pytest.raises(ValueError, match="unknown KMS key purpose"):
        keys.key_policy("dynamodb", account_id=ACCOUNT, region=REGION)
