"""The Helm values check on the chart written for these tests (fixtures/demo-chart): each rule shown
passing on good values and failing on a broken copy.

Usage: .venv/bin/pytest tests/tools/validation/test_helm.py -q
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from tests.tools.validation.charts import demo_chart
from tools.validation import helm, snapshot

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = "https://charts.example.com"

GOOD = {
    "replicas": 3,
    "image": {"tag": "2.0"},
    "nodeSelector": {"any-label.example.com/x": "y"},  # empty map in values.yaml: free-form
    "tolerations": [{"operator": "Exists"}],
    "resources": {"requests": {"cpu": "1"}},
    "jvmOptions": ["-Xmx1g"],
    "env": {"ANY_NAME": "1"},  # a template ranges over env: its keys are the user's
    "volumes": [{"name": "cache", "size": "10Gi"}],
    "mode": "safe",
    "service": {"type": "LoadBalancer", "port": 443, "annotations": {"a": "b"}},
    "labels": {"team": "ml"},
    "metrics": {"port": 9100},
    "global": {"imageRegistry": "registry.example.com"},
    "sidecar": {"enabled": True, "image": "example/other", "args": ["--verbose"]},
    "extra": {"enabled": True, "flag": False, "more": {"deep": 1}},
}


@pytest.fixture(scope="module")
def snaps(tmp_path_factory) -> helm.Snapshots:
    work = tmp_path_factory.mktemp("chart")
    chart = demo_chart(work)
    root = work / "schemas"
    snapshot.write_chart_snapshots(chart, root / "charts", {"repo": "tests"})
    index = snapshot.merge_index(None, REPO, {"demo": ["1.2.3", "1.2.2"]}, {"from": "tests"})
    index["repositories"]["https://unlisted.example.com"] = {"charts": {}, "sources": {}, "unverified": "no index"}
    snapshot.write_json(index, root / "charts" / "index.json")
    return helm.Snapshots(root)


def check(values, snaps, version="1.2.3", repo=REPO, chart="demo") -> list[str]:
    result = helm.check_release(helm.Release(name="rel", chart=chart, version=version, repo=repo, values=values),
                                snaps)
    return [p.removeprefix("release rel (demo 1.2.3): ") for p in result.problems]


def edit(path: str, value) -> dict:
    values = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = values
    for p in parents:
        node = node[p]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return values


def test_good_values_pass(snaps):
    assert check(GOOD, snaps) == []
    assert check({}, snaps) == ["values.service: values.schema.json: 'port' is a required property"]


def test_unknown_keys_are_reported_at_any_depth(snaps):
    assert check(edit("replicaCount", 2), snaps) == ["values.replicaCount: the chart defines no such key (Helm ignores it)"]
    assert check(edit("image.digest", "sha256:x"), snaps) == [
        "values.image.digest: the chart defines no such key (Helm ignores it)"]
    assert check(edit("volumes", [{"name": "v", "sizeLimit": "1Gi"}]), snaps) == [
        "values.volumes[0].sizeLimit: the chart defines no such key (Helm ignores it)"]


def test_types_follow_values_yaml_and_ranged_keys_need_a_list_or_map(snaps):
    assert check(edit("replicas", "3"), snaps) == [
        "values.replicas: the chart takes integer here, got string",
        "values.replicas: values.schema.json: '3' is not of type 'integer'"]
    assert check(edit("volumes", {"name": "v"}), snaps) == ["values.volumes: the chart takes array here, got object"]
    assert check(edit("jvmOptions", "-Xmx1g"), snaps) == [
        "values.jvmOptions: a template ranges over this key, so it must be a list or a map, got string"]


def test_schema_enums_bounds_and_required_keys(snaps):
    assert check(edit("mode", "slow"), snaps) == ["values.mode: values.schema.json: 'slow' is not one of ['fast', 'safe']"]
    assert check(edit("replicas", 0), snaps) == ["values.replicas: values.schema.json: 0 is less than the minimum of 1"]
    assert check(edit("service.port", ...), snaps) == ["values.service: values.schema.json: 'port' is a required property"]
    assert check(edit("labels", {"team": 1}), snaps) == ["values.labels.team: values.schema.json: 1 is not of type 'string'"]


def test_chart_versions_must_be_in_the_index_and_snapshotted(snaps):
    assert check(GOOD, snaps, version="9.9.9") == [
        "release rel (demo 9.9.9): version 9.9.9 is not in the index of https://charts.example.com (newest: 1.2.3, 1.2.2)",
        "release rel (demo 9.9.9): no snapshot tests/schemas/charts/demo-9.9.9.json (run make schemas)"]
    assert check(GOOD, snaps, version="1.2.2") == [
        "release rel (demo 1.2.2): no snapshot tests/schemas/charts/demo-1.2.2.json (run make schemas)"]
    assert "is not in the index snapshot" in check(GOOD, snaps, repo="https://other.example.com")[0]


def test_an_unverified_repository_is_reported_as_such_never_as_passed(snaps):
    result = helm.check_release(helm.Release(name="rel", chart="demo", version="1.2.3",
                                             repo="https://unlisted.example.com", values=GOOD), snaps)
    assert result.problems == []
    assert result.unverified == ["release rel (demo 1.2.3): the version is not checked offline: no index"]


def test_subchart_values_are_checked_against_the_subchart(snaps):
    assert check(edit("sidecar.imagePullPolicy", "Always"), snaps) == [
        "values.sidecar.imagePullPolicy: the chart defines no such key (Helm ignores it)"]
    assert check(edit("sidecar.args", "--verbose"), snaps) == ["values.sidecar.args: the chart takes array here, got string"]
    # `extra` is the alias of the packaged dependency.
    assert check(edit("extra.flag", "yes"), snaps) == ["values.extra.flag: the chart takes boolean here, got string"]
    assert check(edit("extra.other", 1), snaps) == ["values.extra.other: the chart defines no such key (Helm ignores it)"]
    assert check(edit("global.imageRegistryy", "x"), snaps) == [
        "values.global.imageRegistryy: the chart defines no such key (Helm ignores it)"]


def test_a_subchart_without_snapshot_is_a_problem(snaps, tmp_path):
    root = tmp_path / "schemas"
    shutil.copytree(snaps.dir, root / "charts")
    (root / "charts" / "packaged-2.0.0.json").unlink()
    problems = check(GOOD, helm.Snapshots(root))
    assert problems == ["values under 'extra' go to subchart packaged 2.0.0, which has no snapshot (run make schemas)"]


def test_dependency_version_constraints():
    assert helm.version_matches("0.1.*", "0.1.7") and not helm.version_matches("0.1.*", "0.2.0")
    assert helm.version_matches("0.12.*", "0.12.3") and helm.version_matches("2.0.0", "2.0.0")
    assert helm.version_matches(">=1.2.0 <2.0.0", "1.9.9") and not helm.version_matches(">=1.2.0 <2.0.0", "2.0.0")
    assert not helm.version_matches("~1.2", "1.2.0")  # not understood: never a silent match


def test_releases_are_read_from_a_plan_document():
    plan = {"stack": "s", "resources": [
        {"type": helm.RELEASE_TYPE, "name": "r1", "inputs": {
            "name": "kueue", "chart": "oci://registry.k8s.io/kueue/charts/kueue", "version": "0.19.2",
            "namespace": "kueue-system", "values": {"a": 1}}},
        {"type": helm.RELEASE_TYPE, "name": "r2", "inputs": {
            "name": "mon", "chart": "kube-prometheus-stack", "version": "88.5.3",
            "repositoryOpts": {"repo": "https://prometheus-community.github.io/helm-charts/"}}},
        {"type": "kubernetes:core/v1:ConfigMap", "inputs": {}},
    ]}
    first, second = helm.releases(plan)
    assert (first.chart_name, first.repository, first.namespace) == ("kueue", "oci://registry.k8s.io/kueue/charts",
                                                                     "kueue-system")
    assert (second.chart_name, second.repository, dict(second.values)) == (
        "kube-prometheus-stack", "https://prometheus-community.github.io/helm-charts", {})
    assert json.dumps(second.label) == '"release mon (kube-prometheus-stack 88.5.3)"'
