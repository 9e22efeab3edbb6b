"""The platform's own Kubernetes objects on the local control plane: the CRDs they need and every object a stack's
plan creates outside Helm releases, applied with server-side apply.

Usage:
    python -m infra.plan --stack aws-dev --out build/plan
    install_crds(plane)                                       # the pinned charts' CRDs (tests/schemas/crds)
    install_crds(bare, with_modules=True)                     # and Kueue's and JobSet's, on a bare plane
    apply_plan(plane, Path("build/plan/aws-dev/k8s"))         # namespaces first, then the rest

The CRDs of the charts the stacks install (kube-prometheus-stack, Karpenter, CloudNativePG, the node readiness
controller, KServe, GKE's networking API, the VPC CNI's ENIConfig) come from the snapshots `make schemas` takes of
each pinned chart or CRD file: every version's structural schema with its defaults, enums and CEL rules, which is
what the API server validates against (descriptions and rule messages are not kept). Kueue's and JobSet's come
whole from their pinned modules (tools/cluster/controllers.py), with their conversion webhooks where Kueue runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tools.cluster import controllers
from tools.cluster.plane import Plane

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "schemas" / "crds"
# Installed whole, with their webhooks, by the plane itself.
FROM_MODULES = ("kueue.x-k8s.io", "jobset.x-k8s.io")


def crd_from_snapshot(snap: dict[str, Any]) -> dict[str, Any]:
    """A CustomResourceDefinition rebuilt from its snapshot (tools.validation.snapshot.crd_snapshots)."""
    names = snap["names"]
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{names['plural']}.{snap['group']}"},
        "spec": {"group": snap["group"], "scope": snap["scope"],
                 "names": {"kind": names["kind"], "plural": names["plural"], "singular": names["kind"].lower(),
                           "listKind": names["kind"] + "List"},
                 "versions": [{"name": v, "served": d["served"], "storage": d["storage"],
                               "schema": {"openAPIV3Schema": d["schema"]}, "subresources": {"status": {}}}
                              for v, d in snap["versions"].items()]},
    }


def snapshot_crds() -> list[dict[str, Any]]:
    out = []
    for path in sorted(SNAPSHOTS.glob("*.json")):
        snap = json.loads(path.read_text())
        if snap["group"] not in FROM_MODULES:
            out.append(crd_from_snapshot(snap))
    return out


def install_crds(plane: Plane, *, with_modules: bool = False) -> list[str]:
    """Apply every snapshot CRD; returns their names. `with_modules` adds Kueue's and JobSet's from their modules,
    for a plane without their controllers (`Plane.start(controllers=False)`), which would otherwise install them."""
    crds = snapshot_crds()
    if with_modules:
        crds += [*controllers.kueue_crds(), *controllers.jobset_crds()]
    plane.apply(crds)
    return [c["metadata"]["name"] for c in crds]


def plan_objects(k8s_dir: Path) -> list[dict[str, Any]]:
    """Every object of a plan's k8s/ directory, in apply order: namespaces, other cluster-scoped objects
    (policies, flavors, queues, roles), then namespaced ones."""
    objs = [d for p in sorted(k8s_dir.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]

    def rank(obj: dict[str, Any]) -> int:
        if obj["kind"] == "Namespace":
            return 0
        if obj["kind"] == "CustomResourceDefinition":
            return 1
        return 2 if "namespace" not in obj["metadata"] else 3
    return sorted(objs, key=rank)


def apply_plan(plane: Plane, k8s_dir: Path, manager: str = "pulumi-kubernetes") -> list[dict[str, Any]]:
    """Server-side apply every object of the plan; returns what the API server stored."""
    return [r.to_dict() for r in plane.apply(plan_objects(k8s_dir), manager=manager)]
