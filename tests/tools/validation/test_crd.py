"""The CRD check on a CRD written for these tests (fixtures/widgets-crd.yaml): the API server's
structural-schema rules, each shown passing on a good object and failing on a broken copy.

Usage: .venv/bin/pytest tests/tools/validation/test_crd.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tools.validation import crd, snapshot

FIXTURES = Path(__file__).resolve().parent / "fixtures"

GOOD = {
    "apiVersion": "example.com/v1", "kind": "Widget",
    "metadata": {"name": "w", "namespace": "demo", "labels": {"anything": "goes"}},
    "spec": {
        "size": "10Gi", "mode": "fast", "description": "a field called description",
        "expires": "2026-01-01T00:00:00Z", "blob": "aGVsbG8=", "owner": None,
        "tags": ["a", "b"], "ports": [{"name": "http", "port": 80}, {"name": "admin", "port": 9090}],
        "labels": {"team": "ml"},
        "template": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"whatever": 1}},
        "extra": {"known": "k", "free": {"any": ["thing"]}},
    },
}


@pytest.fixture(scope="module")
def snaps(tmp_path_factory) -> crd.Snapshots:
    root = tmp_path_factory.mktemp("schemas")
    for snap in snapshot.crd_snapshots((FIXTURES / "widgets-crd.yaml").read_text(), {"repo": "tests"}):
        snapshot.write_json(snap, root / "crds" / snapshot.crd_snapshot_name(snap))
    return crd.Snapshots(root)


def broken(**spec) -> dict:
    obj = copy.deepcopy(GOOD)
    for key, value in spec.items():
        if value is ...:
            del obj["spec"][key]
        else:
            obj["spec"][key] = value
    return obj


def problems(obj, snaps) -> list[str]:
    return crd.validate(obj, snaps).problems


def test_a_good_object_passes_and_defaults_are_applied_first(snaps):
    result = crd.validate(GOOD, snaps)
    assert result.problems == []
    defaulted = crd.apply_defaults(GOOD, snaps.find("example.com/v1", "Widget")[0])
    assert defaulted["spec"]["name"] == "widget" and defaulted["spec"]["minReplicas"] == 1


def test_unknown_fields_are_reported_unless_preserved(snaps):
    assert problems(broken(colour="red"), snaps) == ["spec.colour: unknown field (the API server drops it)"]
    obj = copy.deepcopy(GOOD)
    obj["status"] = {"ready": True, "phase": "x"}
    assert problems(obj, snaps) == ["status.phase: unknown field (the API server drops it)"]
    # Under x-kubernetes-preserve-unknown-fields any field is kept, but declared ones keep their type.
    assert problems(broken(extra={"known": 5, "other": 1}), snaps) == ["spec.extra.known: 5 is not of type 'string'"]


def test_required_enum_and_int_or_string(snaps):
    assert problems(broken(mode=...), snaps) == ["spec: 'mode' is a required property"]
    assert problems(broken(mode="slow"), snaps) == ["spec.mode: 'slow' is not one of ['fast', 'safe']"]
    assert problems(broken(size=10), snaps) == []
    assert problems(broken(size=["10Gi"]), snaps) == ["spec.size: must be an integer or a string (int-or-string), got list"]
    assert problems(broken(size=1.5), snaps)


def test_nullable_and_formats(snaps):
    assert problems(broken(owner="me"), snaps) == []
    assert problems(broken(labels={"team": None}), snaps)  # not nullable
    assert problems(broken(expires="tomorrow"), snaps) == ["spec.expires: 'tomorrow' is not a 'date-time'"]
    assert problems(broken(blob="not base64!"), snaps) == ["spec.blob: 'not base64!' is not a 'byte'"]
    assert problems(broken(address="10.0.0"), snaps) == ["spec.address: '10.0.0' is not a 'ipv4'"]
    # `duration` is a Go duration to the API server, not jsonschema's ISO 8601: not checked here.
    assert problems(broken(address="10.0.0.1", timeout="5m"), snaps) == []


def test_embedded_resources_need_apiversion_and_kind(snaps):
    assert problems(broken(template={"metadata": {"name": "p"}}), snaps) == [
        "spec.template: 'apiVersion' is a required property", "spec.template: 'kind' is a required property"]


def test_list_types_set_and_map_reject_duplicates(snaps):
    assert problems(broken(tags=["a", "a"]), snaps) == ["spec.tags: ['a', 'a'] has non-unique elements"]
    dup = [{"name": "http", "port": 80}, {"name": "http", "port": 81}]
    assert problems(broken(ports=dup), snaps) == [
        "spec.ports[1]: duplicate entry for list-map keys ['name'] (same as [0])"]


def test_cel_rules_are_evaluated_on_the_defaulted_object(snaps):
    # maxReplicas defaults to 3, so minReplicas 5 breaks `self.minReplicas <= self.maxReplicas`.
    assert problems(broken(minReplicas=5), snaps) == [
        "spec: violates the CRD's rule 'self.minReplicas <= self.maxReplicas' (rule is false)"]
    assert problems(broken(ports=[{"name": "big", "port": 70000}]), snaps) == [
        "spec.ports[0].port: violates the CRD's rule 'self > 0 && self < 65536' (rule is false)"]


def test_no_rule_runs_after_an_error_that_blocks_the_api_servers_rules(snaps):
    """The API server runs no CEL rule once the schema found a missing required field, a value outside an enum or
    of the wrong type, or too long a string or list (apiextensions-apiserver's hasBlockingErr); a pattern or bound
    error does not stop them."""
    assert problems(broken(minReplicas=5, mode="slow"), snaps) == [
        "spec.mode: 'slow' is not one of ['fast', 'safe']"]
    assert problems(broken(ports=[{"name": "big", "port": "70000"}]), snaps) == [
        "spec.ports[0].port: '70000' is not of type 'integer'"]
    assert problems(broken(minReplicas=5, maxReplicas=4.5), snaps) == [
        "spec.maxReplicas: 4.5 is not of type 'integer'"]
    assert problems(broken(minReplicas=5, tags=["a", "a"]), snaps) == [
        "spec.tags: ['a', 'a'] has non-unique elements",
        "spec: violates the CRD's rule 'self.minReplicas <= self.maxReplicas' (rule is false)"]


def test_rules_needing_kubernetes_cel_or_old_self_are_listed_not_passed(snaps):
    result = crd.validate(GOOD, snaps)
    assert sorted(map(str, result.unevaluated)) == [
        "spec: 'self.name.lowerAscii() == self.name': uses Kubernetes CEL library functions: lowerAscii",
        "spec: 'self.size == oldSelf.size': transition rule (compares with oldSelf): the API server runs it "
        "on update only",
    ]
    assert sorted((u.category, u.functions) for u in result.unevaluated) == [
        ("kubernetes-cel", ("lowerAscii",)), ("transition", ())]
    ok, why = crd.evaluate_rule("self.?x.orValue(1) == 1", {})
    assert ok is None and "not parsed by cel-python" in why


def test_unknown_kinds_and_unserved_versions_are_errors_not_passes(snaps):
    other = {**GOOD, "kind": "Gadget"}
    assert problems(other, snaps) == ["no CRD snapshot for Gadget.example.com (tests/schemas/crds; run make schemas)"]
    old = {**GOOD, "apiVersion": "example.com/v1alpha1"}
    assert problems(old, snaps) == ["Widget.example.com does not serve version v1alpha1 (served: v1)"]


def test_custom_resources_of_a_plan_are_the_non_kubernetes_groups():
    plan = {"resources": [
        {"type": "kubernetes:example.com/v1:Widget", "inputs": {"apiVersion": "example.com/v1", "kind": "Widget",
                                                                "metadata": {"name": "w"}, "spec": {}}},
        {"type": "kubernetes:kueue.x-k8s.io/v1beta2:LocalQueue", "inputs": {"kind": "LocalQueue"}},
        {"type": "kubernetes:networking.k8s.io/v1:NetworkPolicy", "inputs": {"kind": "NetworkPolicy"}},
        {"type": "kubernetes:core/v1:ConfigMap", "inputs": {"kind": "ConfigMap"}},
        {"type": "kubernetes:helm.sh/v3:Release", "inputs": {"chart": "x"}},
        {"type": "aws:s3/bucket:Bucket", "inputs": {}},
    ]}
    assert [o["kind"] for o in crd.custom_resources(plan)] == ["Widget", "LocalQueue"]
    assert crd.custom_resources(plan)[0]["spec"] == {}


def test_ids_the_offline_plan_made_up_skip_only_shape_checks(snaps, tmp_path):
    """The mocks name every resource's id `<name>-id`; a real id exists only after `pulumi up`. A
    pattern or format check on such a value is noted, anything else about it still fails."""
    plan = {"resources": [{"urn": "urn:a", "name": "efa-sg", "type": "aws:ec2/securityGroup:SecurityGroup"},
                          {"urn": "urn:b", "name": "other", "type": "aws:ec2/subnet:Subnet"}],
            "registrations": {"urn:a": {"id": "efa-sg-id"}, "urn:b": {"id": "subnet-0abc"}}}
    stand_ins = crd.stand_in_ids(plan)
    assert stand_ins == {"efa-sg-id": "resource efa-sg"}  # a provider-shaped id is not a stand-in
    result = crd.validate(broken(expires="efa-sg-id"), snaps, stand_ins)
    assert result.problems == []
    assert result.stand_ins == ["spec.expires: 'efa-sg-id' stands in for the id of resource efa-sg; its format is "
                                "checked at deploy time"]
    assert crd.validate(broken(expires="subnet-0abc"), snaps, stand_ins).problems == [
        "spec.expires: 'subnet-0abc' is not a 'date-time'"]
    assert crd.validate(broken(mode="efa-sg-id"), snaps, stand_ins).problems == [
        "spec.mode: 'efa-sg-id' is not one of ['fast', 'safe']"]
