"""Every plan (four stacks and the fabric variants) against the charts and CRDs at the pinned versions:
every Helm release's values pass the chart check, every custom resource passes its CRD; broken copies
of the real objects fail.

Usage: .venv/bin/pytest tests/tools/validation/test_plans.py -q
"""

from __future__ import annotations

import copy
import json
import re

import pytest

from tests.conftest import ROOT, STACKS
from tools.validation import crd, helm, refresh

DOCS = ROOT / "docs" / "validation.md"


def _release(plan: dict, chart: str) -> helm.Release:
    return next(r for r in helm.releases(plan) if r.chart_name == chart)


def _object(plan: dict, kind: str) -> dict:
    return copy.deepcopy(next(o for o in crd.custom_resources(plan) if o["kind"] == kind))


def _with(release: helm.Release, **changes) -> helm.Release:
    fields = {k: getattr(release, k) for k in ("name", "chart", "version", "repo", "values", "namespace")}
    return helm.Release(**{**fields, **changes})


def test_every_release_passes_the_chart_check(all_plans):
    index = helm.Snapshots().index()
    for stack, plan in all_plans.items():
        results = helm.check_plan(plan)
        assert {r.release.chart_name for r in results} >= {"kube-prometheus-stack", "dcgm-exporter", "kueue", "jobset"}
        assert [p for r in results for p in r.problems] == [], stack
        for r in results:
            # Only a repository the index snapshot marks unverified (with its reason) escapes the version check.
            assert bool(r.unverified) == bool((index.get(r.release.repository) or {}).get("unverified")), r.release


def test_every_custom_resource_passes_its_crd(all_plans):
    for stack, plan in all_plans.items():
        results = crd.check_plan(plan)
        assert {r.kind for r in results} >= {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ResourceFlavor",
                                             "ClusterQueue", "LocalQueue", "JobSet"}, stack
        assert [f"{r.kind}/{r.name}: {p}" for r in results for p in r.problems] == [], stack


def test_every_rule_not_evaluated_offline_is_listed_in_the_docs(all_plans):
    """docs/validation.md has a row per (kind, field, reason) naming the Kubernetes CEL functions."""
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    missing = set()
    for plan in all_plans.values():
        for r in crd.check_plan(plan):
            for u in r.unevaluated:
                path = re.sub(r"\[\d+\]", "[*]", u.path)
                words = [f"`{r.kind}`", f"`{path}`", *(f"`{f}()`" for f in u.functions)]
                words.append("transition" if u.category == "transition" else "")
                if not any(all(w in row for w in words) for row in rows):
                    missing.add(f"{r.kind} {path} {u.category} {u.functions}")
    assert sorted(missing) == []


def test_unverified_repositories_are_documented():
    docs = DOCS.read_text()
    for repo, entry in helm.Snapshots().index().items():
        if entry.get("unverified"):
            assert repo in docs


def test_the_source_table_covers_every_release_at_its_pinned_version(all_plans):
    table = {(s.name, s.version, s.repo) for s in refresh.chart_sources()}
    for plan in all_plans.values():
        for r in helm.releases(plan):
            assert (r.chart_name, r.version, r.repository) in table, r


# ------------------------------------------------------------------- broken copies of the real objects


def test_a_broken_release_fails(plans):
    plan = plans["aws-dev"]
    alluxio = _release(plan, "alluxio")
    values = copy.deepcopy(dict(alluxio.values))
    values["pagestore"] = {"type": "hostPath"}  # no such key in the chart
    values["worker"]["jvmOptions"] = "-Xmx4g"  # the chart concats a list
    problems = helm.check_release(_with(alluxio, values=values)).problems
    assert any("values.pagestore: the chart defines no such key" in p for p in problems)
    assert any("values.worker.jvmOptions: a template ranges over this key" in p for p in problems)
    kps = _release(plan, "kube-prometheus-stack")
    values = copy.deepcopy(dict(kps.values))
    values["prometheus"]["prometheusSpec"]["replicas"] = "2"
    values["grafana"]["persistance"] = {"enabled": True}  # misspelt, under the grafana subchart
    problems = helm.check_release(_with(kps, values=values)).problems
    assert any("values.prometheus.prometheusSpec.replicas: the chart takes integer here, got string" in p
               for p in problems)
    assert any("values.grafana.persistance: the chart defines no such key" in p for p in problems)
    dcgm = _release(plan, "dcgm-exporter")
    problems = helm.check_release(_with(dcgm, version="4.2.3")).problems
    assert any("version 4.2.3 is not in the index of https://nvidia.github.io/dcgm-exporter/helm-charts" in p
               for p in problems)


def test_broken_custom_resources_fail(plans):
    plan = plans["aws-dev"]
    pool = _object(plan, "NodePool")
    pool["spec"]["template"]["spec"]["nodeClass"] = {"name": "x"}  # unknown field
    pool["spec"]["disruption"]["consolidationPolicy"] = "Never"  # not in the enum
    pool["spec"]["limits"]["nvidia.com/gpu"] = ["8"]  # int-or-string given a list
    problems = crd.validate(pool).problems
    assert "spec.template.spec.nodeClass: unknown field (the API server drops it)" in problems
    assert any(p.startswith("spec.disruption.consolidationPolicy: 'Never' is not one of") for p in problems)
    assert "spec.limits.nvidia.com/gpu: must be an integer or a string (int-or-string), got list" in problems
    monitor = _object(plan, "ServiceMonitor")
    del monitor["spec"]["selector"]
    assert "spec: 'selector' is a required property" in crd.validate(monitor).problems
    node_class = _object(plan, "EC2NodeClass")
    node_class["spec"]["role"] = ""
    assert any("violates the CRD's rule \"self != ''\"" in p for p in crd.validate(node_class).problems)
    queue = _object(plan, "ClusterQueue")
    queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"].pop()
    assert any("size(x.resources) == size(self.coveredResources)" in p for p in crd.validate(queue).problems)
    unknown = {**_object(plan, "ServiceMonitor"), "apiVersion": "monitoring.coreos.com/v2"}
    assert crd.validate(unknown).problems == [
        "ServiceMonitor.monitoring.coreos.com does not serve version v2 (served: v1)"]


@pytest.mark.parametrize("stack", STACKS)
def test_alluxio_workers_select_only_gpu_nodes_by_labels_their_pools_really_carry(plans, stack):
    """The worker nodeSelector (the chart has no affinity) must match every GPU pool's node labels as
    the cloud layer sets them (Karpenter NodePool templates on AWS, node pool labels on GKE)."""
    selector = _release(plans[stack], "alluxio").values["worker"]["nodeSelector"]
    assert selector
    labels_per_pool = []
    for res in plans[stack]["resources"]:
        inputs = res["inputs"]
        if res["type"] == "kubernetes:karpenter.sh/v1:NodePool":
            labels_per_pool.append(inputs["spec"]["template"]["metadata"]["labels"])
        elif res["type"] == "gcp:container/nodePool:NodePool" and (inputs.get("nodeConfig") or {}).get("guestAccelerators"):
            labels_per_pool.append(inputs["nodeConfig"]["labels"])
        elif res["type"] == "aws:eks/nodeGroup:NodeGroup" and "gpu-train.io/pool" in (inputs.get("labels") or {}):
            labels_per_pool.append(inputs["labels"])
    assert labels_per_pool, "no GPU pool found in the plan"
    for labels in labels_per_pool:
        assert selector.items() <= labels.items(), (selector, labels)
    assert json.dumps(selector)  # plain strings
