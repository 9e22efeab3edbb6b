"""Reading the resource graph of an offline plan: who a resource waits for, and what a reference names.

Usage (the GCP plan checks do this):
    records = plan_records(json.load(open("build/plan/gcp-prod.json")))
    graph = PlanGraph(records)          # records: [{"urn", "type", "name", "parent", "inputs", "dependencies"?}]
    graph.waits_for(urn)                # every URN that must be created before this one
    graph.find("gcp:compute/network:Network", "gpu-train-gcp-prod-vpc")   # records a reference names

A record is one registered resource as `python -m infra.plan` writes it (plus `dependencies`, the
URNs its registration declared, where the caller recorded them). Pure and tested without mocks.

Why a resource waits for its ancestors' dependencies too: the Python SDK registers a child only
after its parent's URN is known, and a resource's URN is known only after the engine has finished
every resource listed in its `depends_on` (`prepare_resource` awaits them; `RegisterResource`
returns when the step completes). So a `depends_on` given to a component holds back all of its
children (pulumi/runtime/resource.py `prepare_resource`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Record = Mapping[str, Any]


def plan_records(plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The plan's resources, each with the `dependencies` its registration declared (from the
    plan's `registrations`, which `python -m infra.plan` writes)."""
    registrations = plan.get("registrations") or {}
    out = []
    for res in plan["resources"]:
        record = dict(res)
        if res["urn"] in registrations:
            record["dependencies"] = list(registrations[res["urn"]].get("dependencies") or ())
        out.append(record)
    return out


def mock_id(record: Record) -> str:
    """The provider id the offline plan's mocks give a resource (infra/mocks.py: `<name>-id`)."""
    return f"{record['name']}-id"


def identifiers(record: Record) -> set[str]:
    """Every string another resource's input may use to refer to this one: its URN, mock id,
    given name, and the API's relative and full resource names where the type has them."""
    inputs = record.get("inputs") or {}
    ids = {record["urn"], mock_id(record)}
    name = inputs.get("name")
    if isinstance(name, str) and name:
        ids.add(name)
        project = inputs.get("project")
        typ = record["type"]
        if project and typ == "gcp:compute/network:Network":
            ids.add(f"projects/{project}/global/networks/{name}")
        elif project and typ == "gcp:compute/subnetwork:Subnetwork" and inputs.get("region"):
            ids.add(f"projects/{project}/regions/{inputs['region']}/subnetworks/{name}")
    for full in list(ids):
        if full.startswith("projects/"):
            ids.add(f"https://www.googleapis.com/compute/v1/{full}")
    return ids


class PlanGraph:
    """The records of one plan, indexed by URN, with the wait-for relation between them."""

    def __init__(self, records: Iterable[Record]):
        self.records = list(records)
        self.by_urn = {r["urn"]: r for r in self.records}
        self._closure: dict[str, frozenset[str]] = {}

    def of_type(self, *types: str) -> list[Record]:
        return [r for r in self.records if r["type"] in types]

    def find(self, typ: str, reference: str) -> list[Record]:
        """Records of `typ` that `reference` (a name, id, self link or URN) refers to."""
        return [r for r in self.of_type(typ) if reference in identifiers(r)]

    def has_dependencies(self) -> bool:
        """Whether the records carry the `dependencies` each registration declared."""
        return bool(self.records) and all("dependencies" in r for r in self.records)

    def _direct(self, urn: str) -> set[str]:
        """What registering `urn` waited for: its own dependencies and its ancestors'."""
        out: set[str] = set()
        seen: set[str] = set()
        current: str | None = urn
        while current and current in self.by_urn and current not in seen:
            seen.add(current)
            record = self.by_urn[current]
            out.update(record.get("dependencies") or ())
            current = record.get("parent")
        return out

    def waits_for(self, urn: str) -> frozenset[str]:
        """Every URN that is created before `urn` is (transitive)."""
        if urn in self._closure:
            return self._closure[urn]
        if not self.has_dependencies():
            raise ValueError("these records carry no 'dependencies'; record each registration's "
                             "dependencies to check ordering")
        done: set[str] = set()
        todo = list(self._direct(urn))
        while todo:
            dep = todo.pop()
            if dep in done:
                continue
            done.add(dep)
            todo.extend(self._direct(dep) - done)
        result = frozenset(done)
        self._closure[urn] = result
        return result
