"""parliament over every IAM document of every AWS plan: `pytest tests/policies/plan/test_aws_iam_lint.py`.

The real plans (the aws stacks and the p4d / p5en variants from the session fixture `all_plans`) have no
finding outside policies.plan.aws_iam_lint.EXCUSES; copies with one document broken (an unknown action, a
condition key on an action it does not apply to, a malformed ARN) fail, naming the resource.
"""

from __future__ import annotations

import copy
import json

import pytest

from policies.plan import aws_iam_lint
from tests.policies.plan.plan_edits import edit_policy, resource

AWS_PLANS = ("aws-dev", "aws-prod", "aws-prod-p4d", "aws-prod-p5en")


def _statement(doc: dict, sid: str) -> dict:
    return next(s for s in doc["Statement"] if s.get("Sid") == sid)


@pytest.mark.parametrize("stack", AWS_PLANS)
def test_every_iam_document_passes_parliament(all_plans, stack):
    plan = all_plans[stack]
    docs = aws_iam_lint.documents(plan)
    # Trust, inline, key, bucket and queue policies are all in the lint.
    assert {d.kind for d in docs} >= {"trust", "identity", "key", "bucket", "queue"}
    assert len(docs) >= 25
    assert aws_iam_lint.failures(plan) == []


def test_every_excuse_is_still_needed(all_plans):
    used = {f.excused_by for stack in AWS_PLANS for d in aws_iam_lint.documents(all_plans[stack])
            for f in aws_iam_lint.lint(d.document, d.kind)}
    assert {e.name for e in aws_iam_lint.EXCUSES} <= used


def test_unknown_action_fails_naming_the_resource(all_plans):
    def typo(doc):
        doc["Statement"][0]["Action"] = ["s3:GetObjekt"]
    bad = edit_policy(all_plans["aws-dev"], "aws:iam/rolePolicy:RolePolicy", "identities-trainer-research", typo)
    (line,) = aws_iam_lint.failures(bad)
    assert "identities-trainer-research" in line and "UNKNOWN_ACTION" in line and "s3:GetObjekt" in line


def test_grant_condition_on_decrypt_fails(all_plans):
    # The defect Karpenter's controller policy had: kms:GrantIsForAWSResource on kms:Decrypt.
    def grant_on_use(doc):
        _statement(doc, "EbsKeyUse")["Condition"]["Bool"] = {"kms:GrantIsForAWSResource": "true"}
    bad = edit_policy(all_plans["aws-prod"], "aws:iam/rolePolicy:RolePolicy", "karpenter-controller", grant_on_use)
    lines = aws_iam_lint.failures(bad)
    assert lines and all("UNKNOWN_CONDITION_FOR_ACTION" in line for line in lines)
    assert any("kms:GrantIsForAWSResource for action kms:Decrypt" in line for line in lines)


def test_malformed_arn_fails(all_plans):
    def bad_arn(doc):
        _statement(doc, "BucketKey")["Resource"] = "arn:aws:kms:us-east-1:key/x"
    bad = edit_policy(all_plans["aws-prod"], "aws:iam/rolePolicy:RolePolicy", "identities-cache", bad_arn)
    lines = aws_iam_lint.failures(bad)
    assert any("identities-cache" in line and "INVALID_ARN" in line for line in lines), lines


def test_condition_key_of_another_service_fails_in_a_key_policy(all_plans):
    def s3_key_on_kms(doc):
        _statement(doc, "AccountUseViaS3")["Condition"]["StringEquals"]["s3:prefix"] = "x/"
    bad = edit_policy(all_plans["aws-dev"], "aws:kms/key:Key", "keys-s3", s3_key_on_kms)
    assert any("keys-s3" in line and "UNKNOWN_CONDITION_FOR_ACTION" in line for line in aws_iam_lint.failures(bad))


def test_launch_excuse_holds_only_while_every_required_resource_is_granted(all_plans):
    def drop_subnets(doc):
        shared = _statement(doc, "LaunchFromSharedResources")
        shared["Resource"] = [r for r in shared["Resource"] if not r.endswith(":subnet/*")]
    bad = edit_policy(all_plans["aws-prod"], "aws:iam/rolePolicy:RolePolicy", "karpenter-controller", drop_subnets)
    lines = aws_iam_lint.failures(bad)
    assert lines and all("RESOURCE_MISMATCH" in line for line in lines)


def test_resource_star_in_an_identity_policy_is_not_excused(all_plans):
    def star(doc):
        _statement(doc, "BucketKey")["Resource"] = "*"
    bad = edit_policy(all_plans["aws-prod"], "aws:iam/rolePolicy:RolePolicy", "identities-mlflow", star)
    assert any("identities-mlflow" in line and "RESOURCE_STAR" in line for line in aws_iam_lint.failures(bad))


def test_a_policy_in_an_unknown_input_is_refused(all_plans):
    plan = copy.deepcopy(all_plans["aws-dev"])
    res = resource(plan, "aws:sqs/queue:Queue", "karpenter-interruptions")
    res["inputs"]["redrivePolicy"] = json.dumps({"Statement": []})
    with pytest.raises(ValueError, match="redrivePolicy"):
        aws_iam_lint.documents(plan)


def test_cli_reports_and_fails(all_plans, tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(all_plans["aws-dev"]))
    assert aws_iam_lint.main([str(good)]) == 0

    def typo(doc):
        doc["Statement"][0]["Action"] = ["s3:GetObjekt"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(edit_policy(all_plans["aws-dev"], "aws:iam/rolePolicy:RolePolicy",
                                           "identities-trainer-research", typo)))
    assert aws_iam_lint.main([str(bad)]) == 1
    assert "1 findings" in capsys.readouterr().out


def test_cli_names_a_file_that_is_not_a_plan(tmp_path, capsys):
    broken = tmp_path / "truncated.json"
    broken.write_text('{"stack": "aws-dev", "resources": [')
    assert aws_iam_lint.main([str(broken)]) == 2
    err = capsys.readouterr().err
    assert "truncated.json" in err and "not a plan document" in err and "Traceback" not in err
