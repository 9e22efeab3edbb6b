"""Whole-program checks on the offline plans of all four stacks (the session `plans` / `plan_dir`
fixtures from tests/conftest.py): every Kubernetes object in the plan passes kubernetes-validate
strict for the stack's version, custom resources have their required fields, monitors are selected
by the release's Prometheus, and checkov passes with only the documented skips.

Usage: .venv/bin/pytest tests/infra/k8s/test_plan.py -q   (plans every stack: about a minute)
"""

from __future__ import annotations

import pytest

from gpu_train.spec import naming
from infra.plan import kubernetes_objects
from tests.conftest import STACKS, resources_of
from tests.infra.k8s.checks import (
    containers_without_resources,
    cr_problems,
    run_checkov,
    selector_matches,
    validate_strict,
)
from tests.infra.k8s.harness import load_stack


@pytest.mark.parametrize("stack", STACKS)
def test_plan_contains_the_kubernetes_layer(plans, stack):
    plan = plans[stack]
    kinds = {o["kind"] for o in kubernetes_objects(plan)}
    assert {"Namespace", "NetworkPolicy", "ClusterQueue", "LocalQueue", "PrometheusRule"} <= kinds
    components = {r["type"] for r in plan["resources"] if r["type"].startswith("gpu-train:k8s:")}
    assert {"gpu-train:k8s:Tenancy", "gpu-train:k8s:Monitoring", "gpu-train:k8s:GpuStack"} <= components
    namespaces = {o["metadata"]["name"] for o in kubernetes_objects(plan) if o["kind"] == "Namespace"}
    assert {naming.team_namespace(t.name) for t in load_stack(stack).teams} <= namespaces


@pytest.mark.parametrize("stack", STACKS)
def test_plan_objects_pass_strict_validation_and_cr_checks(plans, stack):
    objs = kubernetes_objects(plans[stack])
    errors, custom = validate_strict(objs, load_stack(stack).cluster.kubernetes_version)
    assert errors == []
    assert [p for o in custom for p in cr_problems(o)] == []
    assert [b for o in objs for b in containers_without_resources(o)] == []


@pytest.mark.parametrize("stack", STACKS)
def test_plan_monitors_match_the_prometheus_selector(plans, stack):
    plan = plans[stack]
    release = next(r["inputs"] for r in resources_of(plan, "kubernetes:helm.sh/v3:Release")
                   if r["inputs"].get("name") == naming.MONITORING_RELEASE)
    spec = release["values"]["prometheus"]["prometheusSpec"]
    selector = {"ServiceMonitor": spec["serviceMonitorSelector"], "PodMonitor": spec["podMonitorSelector"],
                "PrometheusRule": spec["ruleSelector"]}
    monitors = [o for o in kubernetes_objects(plan) if o["kind"] in selector]
    assert monitors
    for obj in monitors:
        labels = obj["metadata"].get("labels") or {}
        assert selector_matches(selector[obj["kind"]], labels), f"{obj['kind']} {obj['metadata']}"


def test_plan_manifests_pass_checkov(plan_dir, tmp_path):
    assert run_checkov({s: plan_dir / s / "k8s" for s in STACKS}, tmp_path) == []
