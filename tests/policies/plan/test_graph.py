"""The plan-graph reader: `pytest tests/policies/plan/test_graph.py`."""

from __future__ import annotations

import pytest

from policies.plan.graph import PlanGraph, identifiers, plan_records


def rec(typ, name, inputs=None, deps=(), parent=None):
    return {"urn": f"urn:{typ}::{name}", "type": typ, "name": name, "parent": parent, "inputs": inputs or {},
            "dependencies": list(deps)}


def test_waits_for_is_transitive_and_covers_ancestors():
    a = rec("gcp:x/a:A", "a")
    b = rec("gcp:x/b:B", "b", deps=[a["urn"]])
    parent = rec("gpu-train:x:C", "c", deps=[b["urn"]])
    child = rec("gcp:x/d:D", "d", parent=parent["urn"])
    graph = PlanGraph([a, b, parent, child])
    assert graph.waits_for(child["urn"]) == {a["urn"], b["urn"]}
    assert graph.waits_for(a["urn"]) == frozenset()
    with pytest.raises(ValueError, match="no 'dependencies'"):
        PlanGraph([{k: v for k, v in a.items() if k != "dependencies"}]).waits_for(a["urn"])


def test_identifiers_cover_names_ids_and_api_paths():
    vpc = rec("gcp:compute/network:Network", "network-vpc", {"name": "v", "project": "p"})
    ids = identifiers(vpc)
    assert {"v", "network-vpc-id", "projects/p/global/networks/v",
            "https://www.googleapis.com/compute/v1/projects/p/global/networks/v"} <= ids


def test_plan_records_carry_each_registrations_dependencies():
    plan = {"resources": [{"urn": "u1", "type": "gcp:x/a:A", "name": "a", "parent": None, "inputs": {}},
                          {"urn": "u2", "type": "gcp:x/b:B", "name": "b", "parent": None, "inputs": {}}],
            "registrations": {"u2": {"dependencies": ["u1"]}}}
    records = plan_records(plan)
    assert records[1]["dependencies"] == ["u1"] and "dependencies" not in records[0]
    assert "dependencies" not in plan["resources"][1]  # the plan itself is left as it was
