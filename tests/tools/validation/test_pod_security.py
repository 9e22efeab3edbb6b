"""The Pod Security checks (tools/validation/pod_security.py) against the upstream library's own fixtures.

Usage: .venv/bin/pytest -q tests/tools/validation/test_pod_security.py

fixtures/pod-security-admission-v1.32.json holds every Pod of k8s.io/pod-security-admission's
test/testdata/{baseline,restricted}/v1.32 (tag v0.33.9): each `fail` fixture is a passing pod with one field
changed, named after the check that must refuse it; each `pass` fixture must be admitted. The expected verdict
and check come from upstream, never from the code under test.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from tools.validation import pod_security

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "pod-security-admission-v1.32.json").read_text())
CASES = FIXTURES["cases"]
IDS = {check_id.lower(): check_id for check_id, *_ in pod_security.CHECKS}
REPLACED_BY = {old: new for new, _, _, _, olds in pod_security.CHECKS for old in olds}


def expected_check(case: dict) -> str:
    check = IDS[re.sub(r"\d+$", "", case["name"])]
    # At restricted, the fixture of a baseline check the restricted level replaces fails the replacing check.
    return REPLACED_BY.get(check, check) if case["level"] == "restricted" else check


def test_the_fixtures_cover_every_check_at_both_levels():
    assert FIXTURES["source"]["ref"] == "v0.33.9" and len(CASES) == 128
    failing = {(c["level"], expected_check(c)) for c in CASES if c["expect"] == "fail"}
    baseline = {cid for cid, level, *_ in pod_security.CHECKS if level == "baseline"}
    restricted = {cid for cid, *_ in pod_security.CHECKS} - set(REPLACED_BY)
    assert {cid for level, cid in failing if level == "baseline"} == baseline
    assert {cid for level, cid in failing if level == "restricted"} == restricted


@pytest.mark.parametrize("case", [c for c in CASES if c["expect"] == "fail"],
                         ids=lambda c: f"{c['level']}-{c['name']}")
def test_each_fail_fixture_is_refused_by_its_check(case):
    found = pod_security.evaluate(case["pod"], case["level"], "1.33")
    checks = {v.check for v in found}
    assert expected_check(case) in checks, [str(v) for v in found]
    if case["level"] == "baseline":
        # A baseline fixture changes one field of a passing pod, so only its own check refuses it (a Windows
        # host-process pod must also use the host network: the fixtures set both). At restricted, one change
        # can break several checks (a privileged container without allowPrivilegeEscalation=false).
        extra = {"hostNamespaces"} if expected_check(case) == "windowsHostProcess" else set()
        assert checks - {expected_check(case)} <= extra, [str(v) for v in found]
    assert all(v.fields for v in found)


@pytest.mark.parametrize("case", [c for c in CASES if c["expect"] == "pass"],
                         ids=lambda c: f"{c['level']}-{c['name']}")
def test_each_pass_fixture_is_admitted(case):
    assert pod_security.evaluate(case["pod"], case["level"], "1.33") == []
    assert pod_security.evaluate(pod_security.skeleton(case["pod"]), case["level"], "1.33") == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['level']}-{c['expect']}-{c['name']}")
def test_the_skeleton_keeps_every_verdict_and_privileged_admits_all(case):
    pod = case["pod"]
    assert pod_security.evaluate(pod_security.skeleton(pod), case["level"]) == pod_security.evaluate(pod, case["level"])
    assert pod_security.evaluate(pod, "privileged") == []


def test_restricted_includes_baseline_and_the_version_decides_the_sysctls():
    host = next(c["pod"] for c in CASES if c["level"] == "baseline" and c["name"] == "hostnamespaces0")
    assert {v.check for v in pod_security.evaluate(host, "restricted")} >= {"hostNamespaces"}
    base = next(c["pod"] for c in CASES if c["level"] == "restricted" and c["name"] == "base_linux")
    pod = copy.deepcopy(base)
    pod["spec"].setdefault("securityContext", {})["sysctls"] = [{"name": "net.ipv4.tcp_rmem", "value": "4096"}]
    assert pod_security.evaluate(pod, "baseline", "1.32") == []  # allowed since 1.32 (check_sysctls.go)
    assert [v.check for v in pod_security.evaluate(pod, "baseline", "1.31")] == ["sysctls"]
    with pytest.raises(ValueError, match="unknown Pod Security level"):
        pod_security.evaluate(pod, "strict")


def test_pod_templates_of_each_workload_kind():
    pod = {"metadata": {"labels": {"a": "b"}}, "spec": {"hostPID": True, "containers": [{"name": "c"}]}}
    kinds = {"Deployment": {"spec": {"template": pod}}, "DaemonSet": {"spec": {"template": pod}},
             "CronJob": {"spec": {"jobTemplate": {"spec": {"template": pod}}}},
             "JobSet": {"spec": {"replicatedJobs": [{"template": {"spec": {"template": pod}}}] * 2}}}
    for kind, body in kinds.items():
        found = pod_security.pod_templates({"kind": kind, **body})
        assert found and all(p == pod for _, p in found), kind
    assert len(pod_security.pod_templates({"kind": "JobSet", **kinds["JobSet"]})) == 2
    assert pod_security.pod_templates({"kind": "ConfigMap", "data": {}}) == []
