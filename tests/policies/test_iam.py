"""Policy documents parsed for public access and wildcard grants, on hand-built documents and the real plans.

Usage: `.venv/bin/pytest tests/policies/test_iam.py -q`.
"""

from __future__ import annotations

import json

import pytest

from policies.core import Context, Resource
from policies.iam import public_statements, wildcard_statements
from tests.policies.helpers import details, stack_resources

CTX = Context(stack="aws-dev", environment="dev")
ROOT = "arn:aws:iam::123456789012:root"


def doc(*statements: dict) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


def allow(principal, action="s3:GetObject", **extra) -> dict:
    st = {"Effect": "Allow", "Action": action, "Resource": "arn:aws:s3:::b/*", **extra}
    if principal is not None:
        st["Principal"] = principal
    return st


@pytest.mark.parametrize(("statement", "public"), [
    (allow("*"), True),
    (allow({"AWS": "*"}), True),
    (allow({"AWS": ["*"]}), True),
    (allow({"AWS": [ROOT, "*"]}), True),
    (allow({"AWS": "arn:aws:iam::*:root"}), True),  # any account
    ({"Effect": "Allow", "NotPrincipal": {"AWS": ROOT}, "Action": "sqs:*", "Resource": "*"}, True),
    (allow("*", Condition={"Bool": {"aws:SecureTransport": "true"}}), True),  # not a caller restriction
    (allow("*", Condition={"StringEquals": {"aws:SourceAccount": "*"}}), True),
    (allow({"AWS": ROOT}), False),
    (allow({"Service": "events.amazonaws.com"}), False),
    (allow("*", Condition={"StringEquals": {"aws:SourceAccount": "123456789012"}}), False),
    (allow("*", Condition={"StringEquals": {"aws:PrincipalOrgID": "o-abc123"}}), False),
    (allow("*", Condition={"StringEquals": {"aws:SourceVpce": "vpce-0123"}}), False),
    ({"Effect": "Deny", "Principal": "*", "Action": "s3:*", "Resource": "*"}, False),
])
def test_public_statements(statement, public):
    assert bool(public_statements(doc(statement))) == public


@pytest.mark.parametrize(("statement", "wild"), [
    ({"Effect": "Allow", "Action": "*", "Resource": "*"}, True),
    ({"Effect": "Allow", "Action": ["s3:GetObject", "iam:*"], "Resource": ["*"]}, True),
    ({"Effect": "Allow", "NotAction": "iam:*", "Resource": "*"}, True),
    ({"Effect": "Allow", "Action": "s3:*", "NotResource": "arn:aws:s3:::b"}, True),
    ({"Effect": "Allow", "Action": "ec2:Describe*", "Resource": "*"}, False),  # read-only discovery
    ({"Effect": "Allow", "Action": "s3:*", "Resource": "arn:aws:s3:::b/*"}, False),
    ({"Effect": "Deny", "Action": "*", "Resource": "*"}, False),
])
def test_wildcard_statements(statement, wild):
    assert bool(wildcard_statements(doc(statement))) == wild


def _res(typ: str, **props) -> Resource:
    return Resource(type=typ, name="r", urn=f"urn:pulumi:aws-dev::gpu-train::{typ}::r", props=props)


@pytest.mark.parametrize(("res", "rule", "word"), [
    (_res("aws:s3/bucketPolicy:BucketPolicy", policy=doc(allow("*"))), "no-public-resource-policy", "Principal"),
    (_res("aws:kms/key:Key", policy=doc(allow("*", action="kms:*"))), "no-public-resource-policy", "kms:*"),
    (_res("aws:iam/role:Role", assumeRolePolicy=doc(allow({"AWS": "*"}, action="sts:AssumeRole"))),
     "no-public-resource-policy", "assumeRolePolicy"),
    (_res("aws:sqs/queuePolicy:QueuePolicy", policy=json.loads(doc(allow("*", action="sqs:SendMessage")))),
     "no-public-resource-policy", "sqs:SendMessage"),
    (_res("gcp:storage/bucketIAMMember:BucketIAMMember", role="roles/storage.objectViewer", member="allUsers"),
     "no-public-resource-policy", "allUsers"),
    (_res("gcp:kms/cryptoKeyIAMBinding:CryptoKeyIAMBinding", role="roles/cloudkms.cryptoKeyDecrypter",
          members=["serviceAccount:a@b", "allAuthenticatedUsers"]), "no-public-resource-policy", "allAuthenticated"),
    (_res("gcp:storage/bucketIAMPolicy:BucketIAMPolicy", policyData=json.dumps(
        {"bindings": [{"role": "roles/storage.objectViewer", "members": ["allUsers"]}]})),
     "no-public-resource-policy", "allUsers"),
    (_res("aws:iam/rolePolicy:RolePolicy", policy=doc({"Effect": "Allow", "Action": "*", "Resource": "*"})),
     "no-wildcard-iam", "Resource '*'"),
    (_res("aws:iam/role:Role", inlinePolicies=[{"name": "x", "policy": doc(
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"})}]), "no-wildcard-iam", "inlinePolicies[0]"),
    (_res("aws:iam/rolePolicyAttachment:RolePolicyAttachment",
          policyArn="arn:aws:iam::aws:policy/AdministratorAccess"), "no-wildcard-iam", "AdministratorAccess"),
    (_res("aws:iam/role:Role", managedPolicyArns=["arn:aws-us-gov:iam::aws:policy/IAMFullAccess"]),
     "no-wildcard-iam", "IAMFullAccess"),
    (_res("gcp:projects/iAMMember:IAMMember", role="roles/editor", member="serviceAccount:a@b"),
     "no-wildcard-iam", "roles/editor"),
])
def test_access_rules_on_one_resource(res, rule, word):
    found = details(rule, [res], CTX)
    assert found and any(word in f for f in found), found


def test_resource_policies_are_not_judged_as_identity_policies():
    """A key policy's standard account-root kms:* statement is a resource policy, not a wildcard grant."""
    key = _res("aws:kms/key:Key", policy=doc(allow({"AWS": ROOT}, action="kms:*", Resource="*")))
    assert details("no-wildcard-iam", [key], CTX) == []
    assert details("no-public-resource-policy", [key], CTX) == []


def test_every_real_policy_document_passes(plans):
    checked = 0
    for stack in plans:
        for res in stack_resources(plans, stack):
            for rule in ("no-public-resource-policy", "no-wildcard-iam"):
                assert details(rule, [res], CTX) == [], (stack, res.name, rule)
            checked += any(k in res.props for k in ("policy", "assumeRolePolicy", "member", "policyArn"))
    assert checked > 40  # the plans hold dozens of policies and grants
