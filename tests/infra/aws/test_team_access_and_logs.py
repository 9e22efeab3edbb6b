"""EKS for teams: access entries for team members, NetworkPolicy enforcement in the VPC CNI add-on, and the
CloudWatch Logs groups and identity of the log shipper (infra/aws/cluster.py, infra/aws/log_shipping.py).

The add-on configuration is checked against the aws-vpc-cni chart at the add-on's version (its values are the
add-on's configuration schema; snapshot tests/schemas/charts/aws-vpc-cni-1.20.1.json), IAM documents with
parliament, and the plans of the AWS stacks for what they create.

Run: .venv/bin/pytest tests/infra/aws/test_team_access_and_logs.py -q
"""

from __future__ import annotations

import json

import pytest

from gpu_train.spec.settings import TeamMemberSettings, TeamSettings
from infra.aws import cluster, log_shipping
from infra.aws.settings_checks import log_retention_days, team_access_entries
from policies.plan import aws_iam_lint
from tests.conftest import resources_of
from tests.infra.k8s.harness import load_stack
from tools.validation import helm
from tools.validation.refresh import vpc_cni_tag

ACCOUNT, REGION = "123456789012", "us-east-1"


def _vpc_cni_release(values: dict) -> helm.Release:
    return helm.Release(name="vpc-cni", chart="aws-vpc-cni", version=vpc_cni_tag(cluster.VPC_CNI_VERSION).lstrip("v"),
                        repo="https://aws.github.io/eks-charts", values=values)


def test_the_vpc_cni_configuration_turns_on_network_policy_with_keys_the_chart_defines():
    conf = cluster.vpc_cni_configuration()
    assert conf["enableNetworkPolicy"] == "true"  # a string in the chart's values
    assert conf.get("nodeAgent", {}).get("enabled", True) is True  # the node agent stays on
    result = helm.check_release(_vpc_cni_release(conf))
    assert result.problems == [] and result.unverified == []


@pytest.mark.parametrize(("change", "needle"), [
    ({"enableNetworkPolicy": True}, "takes string here, got boolean"),
    ({"enableNetworkPolicies": "true"}, "defines no such key"),
    ({"nodeAgent": {"enablePolicyLogs": "true"}}, "nodeAgent.enablePolicyLogs: the chart defines no such key"),
])
def test_a_wrong_add_on_key_or_type_is_caught(change, needle):
    conf = {**cluster.vpc_cni_configuration(), **change}
    assert any(needle in p for p in helm.check_release(_vpc_cni_release(conf)).problems)


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod"])
def test_the_planned_add_on_enforces_network_policies(plans, stack):
    (cni,) = [r for r in resources_of(plans[stack], "aws:eks/addon:Addon") if r["inputs"]["addonName"] == "vpc-cni"]
    values = json.loads(cni["inputs"]["configurationValues"])
    assert values == cluster.vpc_cni_configuration()
    assert helm.check_release(_vpc_cni_release(values)).problems == []


def test_access_entries_carry_the_teams_groups_and_nothing_else(plans):
    cfg = load_stack("aws-prod")  # the example stack that lists team members
    entries = {r["inputs"]["principalArn"]: r for r in resources_of(plans["aws-prod"], "aws:eks/accessEntry:AccessEntry")
               if r["inputs"]["type"] == "STANDARD"}
    wanted = team_access_entries(cfg.teams)
    assert wanted and set(entries) == set(wanted)
    bound = {g for t in cfg.teams for g in (*t.submitters, *t.viewers)}
    for principal, res in entries.items():
        assert res["inputs"]["kubernetesGroups"] == list(wanted[principal])
        assert set(res["inputs"]["kubernetesGroups"]) <= bound  # exactly the groups the RoleBindings name
    # A viewer of both teams holds one entry (a principal can have only one per cluster).
    assert list(entries).count("arn:aws:iam::123456789012:role/ml-platform-engineers") == 1
    # No access policy: only the team RoleBindings grant anything (no cluster-admin, no AmazonEKS*Policy).
    assert not resources_of(plans["aws-prod"], "aws:eks/accessPolicyAssociation:AccessPolicyAssociation")
    # A stack that names no members gives no one access.
    assert not [r for r in resources_of(plans["aws-dev"], "aws:eks/accessEntry:AccessEntry")
                if r["inputs"]["type"] == "STANDARD"]


def test_an_entry_keeps_its_name_when_other_members_come_and_go():
    a, b = "arn:aws:iam::1:role/a", "arn:aws:iam::1:role/b"
    assert cluster.access_entry_name("cluster", a) != cluster.access_entry_name("cluster", b)
    assert cluster.access_entry_name("cluster", a) == cluster.access_entry_name("cluster", a)


def test_team_access_entries_merge_a_principal_of_several_teams():
    teams = (TeamSettings(name="a", gpu_quota=1, submitters=("ga",), viewers=("va",),
                               members=(TeamMemberSettings(principal="p1"),
                                        TeamMemberSettings(principal="p2", role="viewer"))),
             TeamSettings(name="b", gpu_quota=1, submitters=("gb",),
                               members=(TeamMemberSettings(principal="p2"),)))
    assert team_access_entries(teams) == {"p1": ("ga",), "p2": ("gb", "va")}


# ------------------------------------------------------------------------------------------ log shipping


def test_the_shippers_policy_writes_only_the_teams_groups():
    arns = [log_shipping.log_group_arn(REGION, ACCOUNT, log_shipping.log_group_name("c", ns))
            for ns in ("team-a", "team-b")]
    doc = log_shipping.shipper_policy(arns)
    (stmt,) = doc["Statement"]
    assert set(stmt["Action"]) == {"logs:CreateLogStream", "logs:DescribeLogStreams", "logs:PutLogEvents"}
    assert stmt["Resource"] == [arns[0], f"{arns[0]}:log-stream:*", arns[1], f"{arns[1]}:log-stream:*"]
    assert not any("*" in r.split(":log-stream:")[0] for r in stmt["Resource"])
    assert [f for f in aws_iam_lint.lint(doc, "identity") if not f.excused] == []
    with pytest.raises(ValueError, match="at least one log group"):
        log_shipping.shipper_policy([])


def test_a_teams_reader_policy_reads_only_its_group():
    arn = log_shipping.log_group_arn(REGION, ACCOUNT, "/gpu-train/c/team-a")
    doc = log_shipping.reader_policy(arn)
    (stmt,) = doc["Statement"]
    assert set(stmt["Action"]) == {"logs:DescribeLogStreams", "logs:FilterLogEvents", "logs:GetLogEvents"}
    assert stmt["Resource"] == [arn, f"{arn}:log-stream:*"]
    assert [f for f in aws_iam_lint.lint(doc, "identity") if not f.excused] == []


@pytest.mark.parametrize("stack", ["aws-dev", "aws-prod"])
def test_every_team_namespace_has_an_encrypted_group_with_the_settings_retention(plans, stack):
    cfg = load_stack(stack)
    plan = plans[stack]
    groups = {r["inputs"]["name"]: r["inputs"] for r in resources_of(plan, "aws:cloudwatch/logGroup:LogGroup")}
    logs_key = next(r["inputs"]["kmsKeyId"] for r in resources_of(plan, "aws:cloudwatch/logGroup:LogGroup")
                    if r["inputs"]["name"].endswith("/cluster"))
    for team in cfg.teams:
        group = groups[log_shipping.log_group_name(f"gpu-train-{stack}", f"team-{team.name}")]
        assert group["retentionInDays"] == log_retention_days(cfg)
        assert group["kmsKeyId"] == logs_key
    (assoc,) = [r["inputs"] for r in resources_of(plan, "aws:eks/podIdentityAssociation:PodIdentityAssociation")
                if r["inputs"]["serviceAccount"] == log_shipping.SHIPPER_SERVICE_ACCOUNT]
    assert assoc["namespace"] == log_shipping.SHIPPER_NAMESPACE
    # The Kubernetes layer's Fluent Bit runs as exactly that service account, in that namespace.
    (release,) = [r["inputs"] for r in resources_of(plan, "kubernetes:helm.sh/v3:Release")
                  if r["inputs"]["chart"] == "aws-for-fluent-bit"]
    assert release["namespace"] == assoc["namespace"]
    assert release["values"]["serviceAccount"]["name"] == assoc["serviceAccount"]
    # Its role writes only these groups; no finding from parliament on any document of the plan.
    (shipper,) = [json.loads(r["inputs"]["policy"]) for r in resources_of(plan, "aws:iam/rolePolicy:RolePolicy")
                  if r["name"] == "log-shipping-shipper"]
    written = {res.split(":log-group:")[1].split(":log-stream:")[0] for res in shipper["Statement"][0]["Resource"]}
    assert written == {log_shipping.log_group_name(f"gpu-train-{stack}", f"team-{t.name}") for t in cfg.teams}
    assert aws_iam_lint.failures(plan) == []
