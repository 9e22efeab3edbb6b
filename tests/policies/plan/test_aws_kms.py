"""Every consumer of every customer-managed key may use it: `pytest tests/policies/plan/test_aws_kms.py`.

The evaluator against hand-worked cases (each written from AWS's evaluation rules, not from the
program's policies); then every AWS plan of the session (`all_plans`), whose consumers are derived
from the plan graph; then copies of a plan with one consumer's access broken, which must be caught.
"""

from __future__ import annotations

import copy
import json

import pytest

from policies.plan import aws_kms
from policies.plan.aws_kms import Principal, Request, evaluate
from tests.policies.plan.plan_edits import edit_policy

ACCOUNT = "111122223333"
REGION = "eu-west-1"
KEY = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd"
ROOT = {"Sid": "Root", "Effect": "Allow", "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"}, "Action": "kms:*",
        "Resource": "*"}
ROLE = f"arn:aws:iam::{ACCOUNT}:role/app"
AWS_PLANS = ("aws-dev", "aws-prod", "aws-prod-p4d", "aws-prod-p5en")


def _doc(*statements):
    return {"Version": "2012-10-17", "Statement": list(statements)}


def _role(*policies) -> Principal:
    return Principal(arn=ROLE, account=ACCOUNT, policies=tuple(policies))


# ---- the evaluator, hand-worked cases ----------------------------------------------------------

def test_root_delegation_needs_an_iam_allow():
    req = Request(principal=_role(), action="kms:Decrypt", key_arn=KEY)
    decision = evaluate(req, _doc(ROOT))
    assert not decision.allowed and "delegates" in decision.reason
    iam_allow = _doc({"Sid": "Use", "Effect": "Allow", "Action": "kms:Decrypt", "Resource": KEY})
    assert evaluate(req, _doc(ROOT), [iam_allow]).allowed
    # The IAM allow for another key does not count.
    other = _doc({"Effect": "Allow", "Action": "kms:Decrypt", "Resource": KEY.replace("1234abcd", "ffff")})
    assert not evaluate(req, _doc(ROOT), [other]).allowed


def test_a_principal_named_in_the_key_policy_needs_nothing_else():
    slr = Principal(arn=f"arn:aws:iam::{ACCOUNT}:role/aws-service-role/autoscaling.amazonaws.com/X", account=ACCOUNT)
    policy = _doc(ROOT, {"Sid": "Slr", "Effect": "Allow", "Principal": {"AWS": [slr.arn]},
                         "Action": ["kms:Decrypt", "kms:ReEncrypt*"], "Resource": "*"})
    assert evaluate(Request(principal=slr, action="kms:Decrypt", key_arn=KEY), policy).allowed
    # ReEncrypt* covers both halves of ReEncrypt.
    assert evaluate(Request(principal=slr, action="kms:ReEncryptTo", key_arn=KEY), policy).allowed
    assert not evaluate(Request(principal=slr, action="kms:Encrypt", key_arn=KEY), policy).allowed


def test_service_principals_have_only_the_key_policy():
    logs = Principal(service=f"logs.{REGION}.amazonaws.com")
    stmt = {"Sid": "Logs", "Effect": "Allow", "Principal": {"Service": f"logs.{REGION}.amazonaws.com"},
            "Action": "kms:Encrypt", "Resource": "*",
            "Condition": {"StringLike": {"kms:EncryptionContext:aws:logs:arn":
                                         f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:*"}}}
    ctx = {"kms:EncryptionContext:aws:logs:arn": f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/x"}
    assert evaluate(Request(principal=logs, action="kms:Encrypt", key_arn=KEY, context=ctx), _doc(ROOT, stmt)).allowed
    # The root statement does not reach a service, and a log group of another account does not match.
    assert not evaluate(Request(principal=logs, action="kms:Encrypt", key_arn=KEY, context=ctx), _doc(ROOT)).allowed
    other = {"kms:EncryptionContext:aws:logs:arn": "arn:aws:logs:eu-west-1:999999999999:log-group:/x"}
    assert not evaluate(Request(principal=logs, action="kms:Encrypt", key_arn=KEY, context=other),
                        _doc(ROOT, stmt)).allowed


def test_via_service_and_grant_conditions():
    grant = _doc({"Effect": "Allow", "Action": "kms:CreateGrant", "Resource": KEY,
                  "Condition": {"StringEquals": {"kms:ViaService": f"ec2.{REGION}.amazonaws.com"},
                                "Bool": {"kms:GrantIsForAWSResource": "true"}}})
    via_ec2 = {"kms:ViaService": f"ec2.{REGION}.amazonaws.com", "kms:GrantIsForAWSResource": "true"}
    req = Request(principal=_role(grant), action="kms:CreateGrant", key_arn=KEY, context=via_ec2)
    assert evaluate(req, _doc(ROOT)).allowed
    # Called through another service, or for a grant that is not for an AWS resource: denied.
    for ctx in ({**via_ec2, "kms:ViaService": f"s3.{REGION}.amazonaws.com"},
                {"kms:ViaService": f"ec2.{REGION}.amazonaws.com"}):
        assert not evaluate(Request(principal=_role(grant), action="kms:CreateGrant", key_arn=KEY, context=ctx),
                            _doc(ROOT)).allowed


def test_a_condition_key_the_request_lacks_never_matches():
    # kms:GrantIsForAWSResource is absent from a Decrypt request: an Allow that requires it is dead.
    decrypt = _doc({"Effect": "Allow", "Action": "kms:Decrypt", "Resource": KEY,
                    "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}}})
    req = Request(principal=_role(decrypt), action="kms:Decrypt", key_arn=KEY,
                  context={"kms:ViaService": f"ec2.{REGION}.amazonaws.com"})
    assert not evaluate(req, _doc(ROOT)).allowed
    # ...unless the operator says IfExists.
    if_exists = _doc({"Effect": "Allow", "Action": "kms:Decrypt", "Resource": KEY,
                      "Condition": {"BoolIfExists": {"kms:GrantIsForAWSResource": "true"}}})
    assert evaluate(Request(principal=_role(if_exists), action="kms:Decrypt", key_arn=KEY), _doc(ROOT)).allowed


def test_explicit_deny_wins_and_caller_account_is_the_principals():
    allow = _doc({"Effect": "Allow", "Action": "kms:*", "Resource": "*"})
    deny = {"Sid": "NoOthers", "Effect": "Deny", "Principal": "*", "Action": "kms:Decrypt", "Resource": "*",
            "Condition": {"StringNotEquals": {"kms:CallerAccount": "999999999999"}}}
    decision = evaluate(Request(principal=_role(allow), action="kms:Decrypt", key_arn=KEY), _doc(ROOT, deny))
    assert not decision.allowed and "NoOthers" in decision.reason
    account_only = {"Sid": "Acct", "Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "kms:Decrypt",
                    "Resource": "*", "Condition": {"StringEquals": {"kms:CallerAccount": ACCOUNT}}}
    assert evaluate(Request(principal=_role(), action="kms:Decrypt", key_arn=KEY), _doc(account_only)).allowed


def test_principal_arn_and_source_conditions():
    stmt = {"Sid": "Arn", "Effect": "Allow", "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"},
            "Action": "kms:Decrypt", "Resource": "*", "Condition": {"ArnLike": {"aws:PrincipalArn": ROLE}}}
    iam_allow = _doc({"Effect": "Allow", "Action": "kms:Decrypt", "Resource": KEY})
    assert evaluate(Request(principal=_role(iam_allow), action="kms:Decrypt", key_arn=KEY), _doc(stmt)).allowed
    other = Principal(arn=f"arn:aws:iam::{ACCOUNT}:role/other", account=ACCOUNT, policies=(iam_allow,))
    assert not evaluate(Request(principal=other, action="kms:Decrypt", key_arn=KEY), _doc(stmt)).allowed
    events = Principal(service="events.amazonaws.com")
    send = {"Sid": "Events", "Effect": "Allow", "Principal": {"Service": "events.amazonaws.com"},
            "Action": "kms:GenerateDataKey*", "Resource": "*",
            "Condition": {"StringEquals": {"aws:SourceAccount": ACCOUNT}}}
    assert evaluate(Request(principal=events, action="kms:GenerateDataKey", key_arn=KEY,
                            context={"aws:SourceAccount": ACCOUNT}), _doc(send)).allowed
    assert not evaluate(Request(principal=events, action="kms:GenerateDataKey", key_arn=KEY,
                                context={"aws:SourceAccount": "999999999999"}), _doc(send)).allowed


def test_unmodelled_constructs_are_refused_not_guessed():
    with pytest.raises(ValueError, match="NotAction"):
        evaluate(Request(principal=_role(), action="kms:Decrypt", key_arn=KEY),
                 _doc({"Effect": "Allow", "Principal": "*", "NotAction": "kms:Encrypt", "Resource": "*"}))
    with pytest.raises(ValueError, match="NumericLessThan"):
        evaluate(Request(principal=_role(), action="kms:Decrypt", key_arn=KEY),
                 _doc({"Effect": "Allow", "Principal": "*", "Action": "kms:Decrypt", "Resource": "*",
                       "Condition": {"NumericLessThan": {"kms:RecipientAttestation:X": "1"}}}))


# ---- the plans ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stack", AWS_PLANS)
def test_every_consumer_of_every_key_may_use_it(all_plans, stack):
    plan = all_plans[stack]
    found = aws_kms.consumers(plan)
    whys = {c.why for c in found}
    assert {"managed node group volumes (EC2 Auto Scaling)", "Karpenter node volumes", "EBS CSI persistent volumes",
            "log group encryption", "EventBridge sends to the encrypted queue", "receives from the encrypted queue",
            "repository creation (ECR grants)", "Secrets envelope encryption (cluster role)", "reads objects",
            "writes objects"} <= whys
    if stack.startswith("aws-prod"):
        assert "database kmsKeyId" in whys and "database performanceInsightsKmsKeyId" in whys
    # Every customer key in the plan has a consumer.
    assert {c.key_arn for c in found} == set(aws_kms._key_policies(plan))
    assert aws_kms.problems(plan) == []


def _drop_sids(*sids):
    return lambda doc: doc.__setitem__("Statement", [s for s in doc["Statement"] if s.get("Sid") not in sids])


KEY_TYPE = "aws:kms/key:Key"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"


@pytest.mark.parametrize(("what", "typ", "name", "edit", "expect"), [
    ("Auto Scaling's role left out of the ebs key policy", KEY_TYPE, "keys-ebs",
     _drop_sids("ServiceLinkedRoleUse", "ServiceLinkedRoleGrants"), "AWSServiceRoleForAutoScaling may not"),
    ("CloudWatch Logs left out of the logs key policy", KEY_TYPE, "keys-logs", _drop_sids("CloudWatchLogs"),
     "logs.us-east-1.amazonaws.com may not kms:Encrypt"),
    ("EventBridge left out of the sqs key policy", KEY_TYPE, "keys-sqs", _drop_sids("EventBridgeToSqs"),
     "events.amazonaws.com may not kms:GenerateDataKey"),
    ("Karpenter's IAM policy without the queue key", ROLE_POLICY, "karpenter-controller",
     _drop_sids("InterruptionQueueKey"), "karpenter may not kms:Decrypt"),
    ("the cluster role without its Secrets key policy", ROLE_POLICY, "cluster-control-plane-kms",
     _drop_sids("SecretsEncryption"), "Secrets envelope encryption (cluster role)"),
    ("a trainer role without the bucket key", ROLE_POLICY, "identities-trainer-research", _drop_sids("BucketKey"),
     "trainer-research may not kms:"),
    # The via-ECR statement alone lacks RetireGrant, which deleting the repository needs.
    ("the account root statement gone from the ecr key", KEY_TYPE, "keys-ecr", _drop_sids("AccountAdministration"),
     "may not kms:RetireGrant"),
])
def test_a_broken_copy_is_caught(all_plans, what, typ, name, edit, expect):
    plan = all_plans["aws-prod"]
    assert aws_kms.problems(plan) == []
    lines = aws_kms.problems(edit_policy(plan, typ, name, edit))
    assert lines and any(expect in line for line in lines), (what, lines[:3])


def test_wrong_via_service_is_caught(all_plans):
    def via_s3(doc):
        for s in doc["Statement"]:
            if s.get("Sid", "").startswith("EbsKey"):
                s["Condition"]["StringEquals"]["kms:ViaService"] = "s3.us-east-1.amazonaws.com"
    lines = aws_kms.problems(edit_policy(all_plans["aws-dev"], ROLE_POLICY, "karpenter-controller", via_s3))
    assert lines and all("Karpenter node volumes" in line for line in lines)
    assert {line.split(" may not ")[1].split(" ")[0] for line in lines} == set(aws_kms.EBS.actions)


def test_a_named_principal_must_exist_before_the_key(all_plans):
    plan = copy.deepcopy(all_plans["aws-prod"])
    plan["resources"] = [r for r in plan["resources"] if r["type"] != "aws:iam/serviceLinkedRole:ServiceLinkedRole"]
    plan["invokes"] = [i for i in plan["invokes"] if i["token"] != "aws:iam/getRoles:getRoles"]
    lines = aws_kms.named_principals_exist(plan)
    assert len(lines) == 1 and "AWSServiceRoleForAutoScaling" in lines[0] and "keys-ebs" in lines[0]


def test_cli_reports_and_fails(all_plans, tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(all_plans["aws-dev"]))
    assert aws_kms.main([str(good)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(edit_policy(all_plans["aws-dev"], KEY_TYPE, "keys-logs", _drop_sids("CloudWatchLogs"))))
    assert aws_kms.main([str(bad)]) == 1
    assert "denied" in capsys.readouterr().out
