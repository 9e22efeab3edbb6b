"""The CrossGuard adapter: policies built from the rules report through `report_violation`.

Usage: `.venv/bin/pytest tests/policies/test_crossguard.py -q`. policies/__main__.py is never imported
(building the PolicyPack starts a gRPC server that never returns); these tests call the policies'
validate exactly as the analyzer does, with props wrapped in the engine's unknown-checking proxies.
"""

from __future__ import annotations

import pytest
from pulumi_policy import (
    EnforcementLevel,
    PolicyResource,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.proxy import unknown_checking_proxy

from policies.crossguard import build_policies
from policies.registry import RULES

LT_URN = "urn:pulumi:aws-dev::gpu-train::gpu-train:aws:GpuNodeGroups$aws:ec2/launchTemplate:LaunchTemplate::gpu"


def _policy(name):
    return next(p for p in build_policies() if p.name == name)


def _launch_template(tokens: str) -> dict:
    return {"metadataOptions": {"httpTokens": tokens, "httpPutResponseHopLimit": 1},
            "tags": {"project": "gpu-train", "stack": "aws-dev", "environment": "dev", "managed-by": "pulumi"}}


def test_every_rule_becomes_a_policy_of_the_right_kind_and_level():
    policies = build_policies()
    assert [p.name for p in policies] == [r.id for r in RULES]
    for policy, rule in zip(policies, RULES, strict=True):
        kind = ResourceValidationPolicy if rule.scope == "resource" else StackValidationPolicy
        assert isinstance(policy, kind)
        assert policy.enforcement_level == (EnforcementLevel.MANDATORY if rule.level == "mandatory"
                                            else EnforcementLevel.ADVISORY)
        assert policy.remediation_steps == rule.remediation
    cap = _policy("gpu-total-cap")
    assert set(cap.config_schema.properties) == {"maxGpus", "maxGpusByStack"}


@pytest.mark.parametrize(("tokens", "expected"), [("required", 0), ("optional", 1)])
def test_resource_policy_validate(tokens, expected, monkeypatch):
    monkeypatch.setenv("PULUMI_STACK", "aws-dev")
    reports = []
    args = ResourceValidationArgs("aws:ec2/launchTemplate:LaunchTemplate",
                                  unknown_checking_proxy(_launch_template(tokens)), LT_URN, "gpu", None, None,
                                  config={})
    _policy("imdsv2-required").validate(args, lambda msg, urn=None: reports.append((msg, urn)))
    assert len(reports) == expected
    for msg, urn in reports:
        assert urn == LT_URN
        assert "[imdsv2-required]" in msg and "'gpu'" in msg and LT_URN in msg and "Remediation:" in msg


def test_resource_policy_reads_its_config(monkeypatch):
    monkeypatch.setenv("PULUMI_STACK", "aws-dev")
    props = _launch_template("required")
    reports = []
    args = ResourceValidationArgs("aws:ec2/launchTemplate:LaunchTemplate", unknown_checking_proxy(props), LT_URN,
                                  "gpu", None, None, config={"requiredTags": ["project", "owner"]})
    _policy("required-tags").validate(args, lambda msg, urn=None: reports.append(msg))
    assert len(reports) == 1 and "owner" in reports[0]


def _pool(name: str, limit: int) -> PolicyResource:
    props = {"spec": {"limits": {"nvidia.com/gpu": limit}, "template": {"spec": {"requirements": [
        {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5.48xlarge"]},
        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]}]}}}}
    return PolicyResource("kubernetes:karpenter.sh/v1:NodePool", unknown_checking_proxy(props),
                          f"urn:pulumi:aws-prod::gpu-train::kubernetes:karpenter.sh/v1:NodePool::{name}", name,
                          None, None, None, [], {})


@pytest.mark.parametrize(("config", "expected"), [({}, 0), ({"maxGpus": 32}, 1),
                                                   ({"maxGpus": 64, "maxGpusByStack": {"aws-prod": 16}}, 1)])
def test_stack_policy_validate_uses_config_and_stack(config, expected, monkeypatch):
    monkeypatch.setenv("PULUMI_STACK", "aws-prod")
    reports = []
    args = StackValidationArgs([_pool("a", 32), _pool("b", 16)], config=config)
    _policy("gpu-total-cap").validate(args, lambda msg, urn=None: reports.append((msg, urn)))
    assert len(reports) == expected
    if expected:
        assert "48 GPUs" in reports[0][0] and "aws-prod" in reports[0][0] and reports[0][1] is None


def _daemonset(host_network: bool) -> dict:
    pod = {"securityContext": {"runAsNonRoot": True}, "hostNetwork": host_network,
           "containers": [{"name": "agent", "image": "registry.example/agent@sha256:" + "0" * 64,
                           "securityContext": {"allowPrivilegeEscalation": False},
                           "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent", "namespace": "monitoring"},
            "spec": {"template": {"spec": pod}}}


@pytest.mark.parametrize(("host_network", "expected"), [(False, 0), (True, 1)])
def test_kubernetes_object_rules_read_the_engines_proxies(host_network, expected, monkeypatch):
    monkeypatch.setenv("PULUMI_STACK", "aws-dev")
    urn = "urn:pulumi:aws-dev::gpu-train::kubernetes:apps/v1:DaemonSet::agent"
    reports = []
    args = ResourceValidationArgs("kubernetes:apps/v1:DaemonSet", unknown_checking_proxy(_daemonset(host_network)),
                                  urn, "agent", None, None, config={})
    _policy("pod-host-isolation").validate(args, lambda msg, urn=None: reports.append(msg))
    assert len(reports) == expected
    assert all("hostNetwork" in m for m in reports)


def _sg(cidrs: list[str]) -> PolicyResource:
    props = {"ingress": [{"protocol": "tcp", "fromPort": 22, "toPort": 22, "cidrBlocks": cidrs}],
             "tags": {"project": "gpu-train"}}
    return PolicyResource("aws:ec2/securityGroup:SecurityGroup", unknown_checking_proxy(props),
                          "urn:pulumi:aws-dev::gpu-train::aws:ec2/securityGroup:SecurityGroup::sg", "sg",
                          None, None, None, [], {})


@pytest.mark.parametrize(("cidrs", "expected"), [(["10.0.0.0/8"], 0), (["0.0.0.0/1", "128.0.0.0/1"], 1)])
def test_stack_policy_normalises_ranges_through_the_proxies(cidrs, expected, monkeypatch):
    monkeypatch.setenv("PULUMI_STACK", "aws-dev")
    reports = []
    _policy("no-open-ingress").validate(StackValidationArgs([_sg(cidrs)], config={}),
                                        lambda msg, urn=None: reports.append((msg, urn)))
    assert len(reports) == expected
    if expected:
        assert "every public IPv4 address" in reports[0][0] and reports[0][1].endswith("::sg")
