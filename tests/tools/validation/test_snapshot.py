"""The snapshot generator on charts and CRDs written for these tests (tests/tools/validation/fixtures).

Usage: .venv/bin/pytest tests/tools/validation/test_snapshot.py -q

Expected structure is read off the fixture files by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.tools.validation.charts import demo_chart
from tools.validation import snapshot
from tools.validation.gotemplate import ELEMENT

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DEMO = FIXTURES / "demo-chart"


def node(snap: dict, *path: str) -> dict:
    n = snap["values"]
    for p in path:
        n = n["items"] if p == ELEMENT else n["keys"][p]
    return n


def strings(value) -> list[str]:
    if isinstance(value, dict):
        return [*value.keys(), *(s for v in value.values() for s in strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []


@pytest.fixture(scope="module")
def demo() -> dict:
    return snapshot.chart_snapshot(DEMO, {"repo": "tests", "path": "fixtures/demo-chart"})


def test_values_yaml_gives_every_key_path_with_its_type(demo):
    assert demo["chart"] == "demo" and demo["version"] == "1.2.3" and demo["appVersion"] == "4.5"
    assert node(demo, "replicas")["type"] == "integer"
    assert node(demo, "image", "tag")["type"] == "string"
    assert node(demo, "image", "pullPolicy")["type"] == "string"
    assert node(demo, "volumes")["type"] == "array"
    assert node(demo, "volumes", ELEMENT, "size")["type"] == "string"
    assert node(demo, "jvmOptions")["type"] == "null"


def test_free_form_maps_come_from_the_chart_itself(demo):
    assert node(demo, "nodeSelector")["free"] == "empty map default"
    assert node(demo, "tolerations")["free"] == "rendered whole by a template"  # toYaml of a list
    assert node(demo, "labels")["free"].startswith("schema")  # additionalProperties in the schema
    assert "free" not in node(demo, "image") and "free" not in node(demo, "service")


def test_templates_add_the_keys_they_read_and_what_they_iterate(demo):
    for path in (("nameOverride",), ("admin-port",), ("metrics", "port"), ("probe", "periodSeconds"),
                 ("extraPort", "number"), ("extraPort", "protocol"), ("service", "port")):
        assert node(demo, *path)["read"] is True, path
    assert node(demo, "jvmOptions")["iterated"] and node(demo, "env")["iterated"]
    # Helm itself reads dependency conditions.
    assert node(demo, "sidecar", "enabled")["type"] == "boolean"
    assert node(demo, "extra", "enabled")["type"] == "boolean"
    # `toYaml .Values | sha256sum` does not make every key free-form; it is reported instead.
    assert "free" not in demo["values"]
    assert any("whole values tree" in g["why"] for g in demo["gaps"])


def test_schema_keeps_structure_and_drops_what_values_yaml_provides_from_required(demo):
    schema = demo["schema"]
    assert schema["properties"]["mode"]["enum"] == ["fast", "safe"]
    assert "required" not in schema  # replicas, mode and service all have defaults
    assert schema["properties"]["service"]["required"] == ["port"]  # service.type has a default
    assert demo["dependencies"] == [
        {"name": "sidecar", "version": "0.1.*", "condition": "sidecar.enabled"},
        {"name": "packaged", "alias": "extra", "version": "2.0.0", "condition": "extra.enabled"}]


def test_no_prose_reaches_a_snapshot(demo):
    text = json.dumps(demo)
    assert "description" not in text and "title" not in text
    assert "how many pods" not in text and "must not reach" not in text
    assert "example/demo" not in strings(demo)  # defaults' values are not stored, only their types


def test_every_dependency_gets_its_own_snapshot_directory_or_archive(tmp_path):
    chart = demo_chart(tmp_path)
    out = tmp_path / "out"
    written = snapshot.write_chart_snapshots(chart, out, {"repo": "tests", "path": "demo"})
    assert sorted(p.name for p in written) == ["demo-1.2.3.json", "packaged-2.0.0.json", "sidecar-0.1.7.json"]
    packaged_snap = json.loads((out / "packaged-2.0.0.json").read_text())
    assert packaged_snap["values"]["keys"]["more"]["keys"]["deep"]["read"] is True
    assert packaged_snap["source"]["path"] == "demo/charts/packaged-2.0.0.tgz"
    sidecar = json.loads((out / "sidecar-0.1.7.json").read_text())
    assert sidecar["values"]["keys"]["args"]["free"] == "rendered whole by a template"
    assert sidecar["generator"] == snapshot.GENERATOR


def test_crd_snapshot_keeps_structure_rules_and_defaults_without_prose():
    (snap,) = snapshot.crd_snapshots((FIXTURES / "widgets-crd.yaml").read_text(), {"repo": "tests"}, "widgets")
    assert (snap["group"], snap["names"], snap["scope"]) == ("example.com", {"kind": "Widget", "plural": "widgets"},
                                                             "Namespaced")
    assert snap["versions"]["v1alpha1"]["served"] is False and snap["versions"]["v1"]["storage"] is True
    spec = snap["versions"]["v1"]["schema"]["properties"]["spec"]
    assert "description" not in spec and "description" not in spec["properties"]["size"]
    assert spec["properties"]["description"] == {"type": "string"}  # a field named description stays
    assert spec["properties"]["name"]["default"] == "widget"
    assert [r["rule"] for r in spec["x-kubernetes-validations"]][0] == "self.minReplicas <= self.maxReplicas"
    assert all("message" not in r for r in spec["x-kubernetes-validations"])
    assert snapshot.crd_snapshot_name(snap) == "example.com_widgets.json"


def test_index_versions_and_merge():
    index = "entries:\n  demo:\n  - version: 1.2.3\n  - version: 1.2.2\n  other:\n  - version: 9.9.9\n"
    assert snapshot.index_versions(index, ["demo"]) == {"demo": ["1.2.3", "1.2.2"]}
    with pytest.raises(snapshot.SnapshotError, match="lists no chart 'missing'"):
        snapshot.index_versions(index, ["missing"], "repo/index.yaml")
    doc = snapshot.merge_index({"repositories": {"https://r": {"charts": {}, "sources": {}, "unverified": "x"}}},
                               "https://r", {"demo": ["1.2.3"]}, {"from": "index.yaml"})
    assert doc["repositories"]["https://r"] == {"charts": {"demo": ["1.2.3"]}, "sources": {"demo": {"from": "index.yaml"}}}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.validation.snapshot", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_writes_snapshots_and_names_a_bad_source_in_one_line(tmp_path):
    ok = _cli("crd", str(FIXTURES / "widgets-crd.yaml"), "--out", str(tmp_path), "--source-repo", "tests")
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "example.com_widgets.json").read_text())["source"] == {"repo": "tests"}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "Chart.yaml").write_text("name: bad\nversion: 0.0.1\n")
    (bad / "values.yaml").write_text("a: [unclosed\n")
    failed = _cli("chart", str(bad), "--out", str(tmp_path))
    assert failed.returncode == 2
    assert failed.stderr.startswith("error: ") and "values.yaml" in failed.stderr
    assert "Traceback" not in failed.stderr and len(failed.stderr.strip().splitlines()) == 1
    missing = _cli("chart", str(tmp_path / "nowhere"), "--out", str(tmp_path))
    assert missing.returncode == 2 and "no Chart.yaml" in missing.stderr
