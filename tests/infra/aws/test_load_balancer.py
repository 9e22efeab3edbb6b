"""The AWS Load Balancer Controller against its own release: `pytest tests/infra/aws/test_load_balancer.py`.

The IAM policy is compared with the policy the controller publishes at the tag the pinned chart ships
(transcribed below from upstream, not from our code); the Helm values are checked against the snapshot
of the pinned chart (tests/schemas/charts), directly and in the aws plans; broken copies fail.
"""

from __future__ import annotations

import copy
import json
from fnmatch import fnmatchcase

import pytest

from infra.aws import iam, load_balancer
from tests.conftest import ROOT
from tools.validation import helm, refresh

REGION, ACCOUNT = "eu-west-1", "111122223333"
TAG = "elbv2.k8s.aws/cluster"
_OWNED = {"Null": {f"aws:ResourceTag/{TAG}": "false"}}
_TAGGED_REQUEST = {"Null": {f"aws:RequestTag/{TAG}": "false"}}
_RETAG = {"Null": {f"aws:RequestTag/{TAG}": "true", f"aws:ResourceTag/{TAG}": "false"}}
_ELB_BALANCERS = ("arn:aws:elasticloadbalancing:*:*:targetgroup/*/*",
                  "arn:aws:elasticloadbalancing:*:*:loadbalancer/net/*/*",
                  "arn:aws:elasticloadbalancing:*:*:loadbalancer/app/*/*")

# kubernetes-sigs/aws-load-balancer-controller, docs/install/iam_policy.json at v3.5.0 (the same file
# as at v2.13.0): each statement as (actions, resources, condition).
REFERENCE_V3_5 = (
    (("iam:CreateServiceLinkedRole",), ("*",),
     {"StringEquals": {"iam:AWSServiceName": "elasticloadbalancing.amazonaws.com"}}),
    (("ec2:DescribeAccountAttributes", "ec2:DescribeAddresses", "ec2:DescribeAvailabilityZones",
      "ec2:DescribeInternetGateways", "ec2:DescribeVpcs", "ec2:DescribeVpcPeeringConnections", "ec2:DescribeSubnets",
      "ec2:DescribeSecurityGroups", "ec2:DescribeInstances", "ec2:DescribeNetworkInterfaces", "ec2:DescribeTags",
      "ec2:GetCoipPoolUsage", "ec2:DescribeCoipPools", "ec2:GetSecurityGroupsForVpc", "ec2:DescribeIpamPools",
      "ec2:DescribeRouteTables", "elasticloadbalancing:DescribeLoadBalancers",
      "elasticloadbalancing:DescribeLoadBalancerAttributes", "elasticloadbalancing:DescribeListeners",
      "elasticloadbalancing:DescribeListenerCertificates", "elasticloadbalancing:DescribeSSLPolicies",
      "elasticloadbalancing:DescribeRules", "elasticloadbalancing:DescribeTargetGroups",
      "elasticloadbalancing:DescribeTargetGroupAttributes", "elasticloadbalancing:DescribeTargetHealth",
      "elasticloadbalancing:DescribeTags", "elasticloadbalancing:DescribeTrustStores",
      "elasticloadbalancing:DescribeListenerAttributes", "elasticloadbalancing:DescribeCapacityReservation"),
     ("*",), None),
    (("cognito-idp:DescribeUserPoolClient", "acm:ListCertificates", "acm:DescribeCertificate",
      "iam:ListServerCertificates", "iam:GetServerCertificate", "waf-regional:GetWebACL",
      "waf-regional:GetWebACLForResource", "waf-regional:AssociateWebACL", "waf-regional:DisassociateWebACL",
      "wafv2:GetWebACL", "wafv2:GetWebACLForResource", "wafv2:AssociateWebACL", "wafv2:DisassociateWebACL",
      "shield:GetSubscriptionState", "shield:DescribeProtection", "shield:CreateProtection",
      "shield:DeleteProtection"), ("*",), None),
    (("ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress"), ("*",), None),
    (("ec2:CreateSecurityGroup",), ("*",), None),
    (("ec2:CreateTags",), ("arn:aws:ec2:*:*:security-group/*",),
     {"StringEquals": {"ec2:CreateAction": "CreateSecurityGroup"}, **_TAGGED_REQUEST}),
    (("ec2:CreateTags", "ec2:DeleteTags"), ("arn:aws:ec2:*:*:security-group/*",), _RETAG),
    (("ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress", "ec2:DeleteSecurityGroup"), ("*",),
     _OWNED),
    (("elasticloadbalancing:CreateLoadBalancer", "elasticloadbalancing:CreateTargetGroup"), ("*",), _TAGGED_REQUEST),
    (("elasticloadbalancing:CreateListener", "elasticloadbalancing:DeleteListener",
      "elasticloadbalancing:CreateRule", "elasticloadbalancing:DeleteRule"), ("*",), None),
    (("elasticloadbalancing:AddTags", "elasticloadbalancing:RemoveTags"), _ELB_BALANCERS, _RETAG),
    (("elasticloadbalancing:AddTags", "elasticloadbalancing:RemoveTags"),
     ("arn:aws:elasticloadbalancing:*:*:listener/net/*/*/*", "arn:aws:elasticloadbalancing:*:*:listener/app/*/*/*",
      "arn:aws:elasticloadbalancing:*:*:listener-rule/net/*/*/*",
      "arn:aws:elasticloadbalancing:*:*:listener-rule/app/*/*/*"), None),
    (("elasticloadbalancing:ModifyLoadBalancerAttributes", "elasticloadbalancing:SetIpAddressType",
      "elasticloadbalancing:SetSecurityGroups", "elasticloadbalancing:SetSubnets",
      "elasticloadbalancing:DeleteLoadBalancer", "elasticloadbalancing:ModifyTargetGroup",
      "elasticloadbalancing:ModifyTargetGroupAttributes", "elasticloadbalancing:DeleteTargetGroup",
      "elasticloadbalancing:ModifyListenerAttributes", "elasticloadbalancing:ModifyCapacityReservation",
      "elasticloadbalancing:ModifyIpPools"), ("*",), _OWNED),
    (("elasticloadbalancing:AddTags",), _ELB_BALANCERS,
     {"StringEquals": {"elasticloadbalancing:CreateAction": ["CreateTargetGroup", "CreateLoadBalancer"]},
      **_TAGGED_REQUEST}),
    (("elasticloadbalancing:RegisterTargets", "elasticloadbalancing:DeregisterTargets"),
     ("arn:aws:elasticloadbalancing:*:*:targetgroup/*/*",), None),
    (("elasticloadbalancing:SetWebAcl", "elasticloadbalancing:ModifyListener",
      "elasticloadbalancing:AddListenerCertificates", "elasticloadbalancing:RemoveListenerCertificates",
      "elasticloadbalancing:ModifyRule", "elasticloadbalancing:SetRulePriorities"), ("*",), None),
)

# What the program leaves out, and why: the values turn WAF, WAFv2 and Shield off; ALB-only features
# (Cognito auth, Outposts customer-owned IPs, IPAM pools) are never asked for: no Ingress is created.
LEFT_OUT = {
    "cognito-idp:DescribeUserPoolClient",
    "waf-regional:GetWebACL", "waf-regional:GetWebACLForResource", "waf-regional:AssociateWebACL",
    "waf-regional:DisassociateWebACL", "wafv2:GetWebACL", "wafv2:GetWebACLForResource", "wafv2:AssociateWebACL",
    "wafv2:DisassociateWebACL", "elasticloadbalancing:SetWebAcl",
    "shield:GetSubscriptionState", "shield:DescribeProtection", "shield:CreateProtection", "shield:DeleteProtection",
    "ec2:GetCoipPoolUsage", "ec2:DescribeCoipPools", "elasticloadbalancing:ModifyIpPools",
}


def _listed(value) -> list:
    return [value] if isinstance(value, str) else list(value)


def _policy() -> dict:
    return iam.load_balancer_controller_policy(region=REGION, account_id=ACCOUNT)


def _actions(doc: dict) -> set[str]:
    return {a for s in doc["Statement"] for a in _listed(s["Action"])}


def _reference_actions() -> set[str]:
    return {a for actions, _, _ in REFERENCE_V3_5 for a in actions}


def _holds(condition: dict | None, required: dict | None) -> bool:
    """Every operator, key and value the reference requires is in the condition."""
    return all((condition or {}).get(op, {}).get(key) == value
               for op, keys in (required or {}).items() for key, value in keys.items())


def _within(resource: str, pattern: str) -> bool:
    """A resource of ours lies inside a reference pattern: the pattern's wildcards match our text (our
    own wildcards count as literal characters, so `*` in ours is only covered by `*` in the pattern)."""
    return fnmatchcase(resource, pattern)


def wider_than_reference(doc: dict) -> list[str]:
    """Each grant of the document no reference statement covers: same action, every condition the
    reference sets, every resource inside the reference's."""
    out = []
    for s in doc["Statement"]:
        if s["Effect"] != "Allow":
            out.append(f"{s.get('Sid')}: {s['Effect']} is not in the reference")
            continue
        for action in _listed(s["Action"]):
            for resource in _listed(s["Resource"]):
                if not any(action in actions and _holds(s.get("Condition"), cond)
                           and any(_within(resource, p) for p in patterns)
                           for actions, patterns, cond in REFERENCE_V3_5):
                    out.append(f"{s.get('Sid')}: {action} on {resource}")
    return out


# ---- IAM policy ------------------------------------------------------------------------------------


def test_reference_transcription_is_the_published_file_shape():
    # 16 statements and 80 distinct actions (docs/install/iam_policy.json at v3.5.0).
    assert len(REFERENCE_V3_5) == 16 and len(_reference_actions()) == 80
    assert _reference_actions() >= LEFT_OUT


def test_policy_grants_every_reference_action_but_the_features_left_out():
    ours = _actions(_policy())
    assert ours == _reference_actions() - LEFT_OUT, (sorted(_reference_actions() - LEFT_OUT - ours),
                                                     sorted(ours - _reference_actions()))


def test_policy_is_nowhere_wider_than_the_reference():
    assert wider_than_reference(_policy()) == []


def test_policy_narrows_resources_to_the_account_and_region():
    for s in _policy()["Statement"]:
        for r in _listed(s["Resource"]):
            if r == "*":
                # Only actions without resource-level permissions keep "*" (List*/Describe*/Get*).
                assert all(a.split(":")[1].startswith(("Describe", "List")) for a in _listed(s["Action"])), s["Sid"]
            else:
                assert r.startswith((f"arn:aws:iam::{ACCOUNT}:", f"arn:aws:elasticloadbalancing:{REGION}:{ACCOUNT}:",
                                     f"arn:aws:ec2:{REGION}:{ACCOUNT}:", f"arn:aws:acm:{REGION}:{ACCOUNT}:")), r


@pytest.mark.parametrize("breakage", ["drop-ownership-condition", "other-region", "missing-action", "extra-action"])
def test_a_broken_policy_fails_the_comparison(breakage):
    doc = copy.deepcopy(_policy())
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    if breakage == "drop-ownership-condition":
        del by_sid["ModifyOwnedBalancers"]["Condition"]
        assert any(p.startswith("ModifyOwnedBalancers: elasticloadbalancing:DeleteLoadBalancer")
                   for p in wider_than_reference(doc))
    elif breakage == "other-region":
        by_sid["Targets"]["Resource"] = "*"
        assert "Targets: elasticloadbalancing:RegisterTargets on *" in wider_than_reference(doc)
    elif breakage == "missing-action":
        by_sid["Targets"]["Action"] = ["elasticloadbalancing:RegisterTargets"]
        assert _actions(doc) != _reference_actions() - LEFT_OUT
    else:
        by_sid["Describe"]["Action"].append("shield:GetSubscriptionState")
        assert _actions(doc) != _reference_actions() - LEFT_OUT


def test_left_out_features_are_turned_off_in_the_values():
    values = load_balancer.helm_values(cluster_name="c", region=REGION, vpc_id="vpc-1", system_selector={})
    # shield:* and wafv2:* / waf-regional:* / SetWebAcl serve exactly these switches.
    assert (values["enableShield"], values["enableWaf"], values["enableWafv2"]) == (False, False, False)


# ---- Helm values against the pinned chart --------------------------------------------------------------


def _snapshot() -> dict:
    path = ROOT / "tests" / "schemas" / "charts" / f"{load_balancer.CHART}-{load_balancer.CHART_VERSION}.json"
    return json.loads(path.read_text())


def _release(values: dict) -> helm.Release:
    return helm.Release(name=load_balancer.CHART, chart=load_balancer.CHART, version=load_balancer.CHART_VERSION,
                        repo=load_balancer.CHART_REPO, values=values, namespace=load_balancer.NAMESPACE)


def _values() -> dict:
    return load_balancer.helm_values(cluster_name="gpu-train-aws-dev", region=REGION, vpc_id="vpc-0abc",
                                     system_selector={"gpu-train.io/system": "true"})


def test_pinned_chart_snapshot_is_the_release_that_ships_the_controller():
    snap = _snapshot()
    assert (snap["chart"], snap["version"]) == (load_balancer.CHART, load_balancer.CHART_VERSION)
    assert snap["appVersion"] == load_balancer.CONTROLLER_VERSION
    assert snap["source"]["repo"] == "aws/eks-charts" and snap["source"]["path"] == "stable/aws-load-balancer-controller"
    others = [p.name for p in (ROOT / "tests" / "schemas" / "charts").glob(f"{load_balancer.CHART}-*.json")]
    assert others == [f"{load_balancer.CHART}-{load_balancer.CHART_VERSION}.json"]


def test_refresh_table_follows_the_pin():
    (row,) = [s for s in refresh.chart_sources() if s.name == load_balancer.CHART]
    assert (row.version, row.repo, row.git, row.git_path) == (
        load_balancer.CHART_VERSION, load_balancer.CHART_REPO, "aws/eks-charts", "stable/aws-load-balancer-controller")


def test_values_pass_the_chart_check():
    result = helm.check_release(_release(_values()))
    assert result.problems == [] and result.unverified == []


def test_every_value_set_is_read_by_the_chart_templates():
    # Helm ignores keys its templates never read: each switch the program relies on must be read.
    keys = _snapshot()["values"]["keys"]
    for key in ("clusterName", "region", "vpcId", "defaultTargetType", "defaultLoadBalancerScheme", "enableShield",
                "enableWaf", "enableWafv2", "keepTLSSecret", "createIngressClassResource", "podDisruptionBudget",
                "replicaCount", "nodeSelector"):
        assert keys[key].get("read"), key
        assert key in _values(), key


@pytest.mark.parametrize("edit, culprit", [
    (lambda v: v.update(keepTlsSecret=True), "keepTlsSecret"),  # misspelt: Helm would ignore it
    (lambda v: v.update(replicaCount="2"), "replicaCount"),
    (lambda v: v["serviceAccount"].update(automount=False), "serviceAccount.automount"),
])
def test_broken_values_fail_naming_the_key(edit, culprit):
    values = copy.deepcopy(_values())
    edit(values)
    problems = helm.check_release(_release(values)).problems
    assert problems and all(culprit in p for p in problems), problems


def test_an_unpublished_chart_version_fails():
    release = helm.Release(name="x", chart=load_balancer.CHART, version="3.5.1", repo=load_balancer.CHART_REPO,
                           values=_values())
    assert any("3.5.1" in p for p in helm.check_release(release).problems)


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod"])
def test_plan_release_passes_the_chart_check(plans, stack):
    (result,) = [r for r in helm.check_plan(plans[stack]) if r.release.chart_name == load_balancer.CHART]
    assert result.release.version == load_balancer.CHART_VERSION
    assert result.problems == [] and result.unverified == []
    values = result.release.values
    assert values["keepTLSSecret"] is True and values["defaultLoadBalancerScheme"] == "internal"
    # No IngressClass, hence no IngressClassParams custom resource rendered by the chart.
    assert values["createIngressClassResource"] is False
