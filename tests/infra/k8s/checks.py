"""Checks shared by the Kubernetes-layer tests: strict schema validation, required fields of custom
resources, containers' resources, and checkov over a directory of manifests.

Usage: `problems = cr_problems(obj)`; `failures = run_checkov(dir)`; `validate_strict(objs, "1.33")`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate

from infra.k8s.monitoring import release_labels, selector_matches

CHECKOV = Path(__file__).resolve().parents[3] / ".venv-checkov" / "bin" / "checkov"


def validate_strict(objects: list[dict[str, Any]], version: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Validate built-in kinds strictly; return (errors, custom resources left for cr_problems)."""
    errors, custom = [], []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            custom.append(obj)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj.get('metadata', {}).get('name')}: {exc}")
    return errors, custom


def _need(cond: bool, problems: list[str], where: str, what: str) -> None:
    if not cond:
        problems.append(f"{where}: {what}")


def cr_problems(obj: dict[str, Any]) -> list[str]:
    """Required fields of the custom resources in our plans (the CRDs' required properties plus the
    cross-field rules their controllers enforce)."""
    p: list[str] = []
    kind = obj.get("kind")
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    where = f"{kind}/{meta.get('name')}"
    _need(bool(obj.get("apiVersion")) and bool(meta.get("name")), p, where, "apiVersion and metadata.name")
    if kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        _need(obj["apiVersion"] == "monitoring.coreos.com/v1", p, where, "apiVersion monitoring.coreos.com/v1")
        _need(selector_matches({"matchLabels": release_labels()}, meta.get("labels") or {}), p, where,
              "labels selected by the kube-prometheus-stack Prometheus")
    if kind == "ServiceMonitor":
        _need(isinstance(spec.get("selector"), dict), p, where, "spec.selector")
        eps = spec.get("endpoints") or []
        _need(bool(eps) and all(e.get("port") or e.get("targetPort") for e in eps), p, where, "spec.endpoints[].port")
    elif kind == "PodMonitor":
        _need(isinstance(spec.get("selector"), dict), p, where, "spec.selector")
        eps = spec.get("podMetricsEndpoints") or []
        _need(bool(eps) and all(e.get("port") or e.get("portNumber") for e in eps), p, where,
              "spec.podMetricsEndpoints[].port")
    elif kind == "PrometheusRule":
        groups = spec.get("groups") or []
        _need(bool(groups), p, where, "spec.groups")
        for g in groups:
            _need(bool(g.get("name")) and bool(g.get("rules")), p, where, "group name and rules")
            for r in g.get("rules") or []:
                _need(bool(r.get("alert") or r.get("record")) and bool(r.get("expr")), p, where,
                      f"rule alert/record + expr: {r}")
    elif kind == "ResourceFlavor":
        _need(bool(spec.get("nodeLabels")), p, where, "spec.nodeLabels")
    elif kind == "ClusterQueue":
        groups = spec.get("resourceGroups") or []
        _need(bool(groups), p, where, "spec.resourceGroups")
        for g in groups:
            covered = g.get("coveredResources") or []
            _need(bool(covered) and bool(g.get("flavors")), p, where, "coveredResources and flavors")
            for f in g.get("flavors") or []:
                names = [r.get("name") for r in f.get("resources") or []]
                _need(names == covered, p, where, f"flavor {f.get('name')} resources {names} != {covered}")
                for r in f.get("resources") or []:
                    _need("nominalQuota" in r, p, where, f"{f.get('name')}/{r.get('name')} nominalQuota")
                    if "borrowingLimit" in r:
                        _need(bool(spec.get("cohort") or spec.get("cohortName")), p, where,
                              "borrowingLimit needs a cohort")
    elif kind == "LocalQueue":
        _need(bool(spec.get("clusterQueue")) and bool(meta.get("namespace")), p, where,
              "spec.clusterQueue and metadata.namespace")
    elif kind == "GKENetworkParamSet":
        _need(bool(spec.get("vpc")) and bool(spec.get("vpcSubnet")), p, where, "spec.vpc and spec.vpcSubnet")
        _need(spec.get("deviceMode") in ("NetDevice", "RDMA"), p, where, "spec.deviceMode NetDevice|RDMA")
    elif kind == "Network":
        ref = spec.get("parametersRef") or {}
        _need(spec.get("type") in ("Device", "L3"), p, where, "spec.type")
        _need(ref.get("kind") == "GKENetworkParamSet" and bool(ref.get("name")), p, where, "spec.parametersRef")
    elif kind == "NodePool" and obj["apiVersion"].startswith("karpenter.sh/"):
        tmpl = (spec.get("template") or {}).get("spec") or {}
        _need(bool(tmpl.get("nodeClassRef")) and bool(tmpl.get("requirements")), p, where,
              "spec.template.spec.nodeClassRef and requirements")
    elif kind == "EC2NodeClass":
        _need(bool(spec.get("subnetSelectorTerms")) and bool(spec.get("securityGroupSelectorTerms")), p, where,
              "subnet and security group selector terms")
        _need(bool(spec.get("role") or spec.get("instanceProfile")), p, where, "role or instanceProfile")
    return p


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Pod":
        return spec
    tmpl = spec.get("template") or (spec.get("jobTemplate") or {}).get("spec", {}).get("template")
    return (tmpl or {}).get("spec")


def containers_without_resources(obj: dict[str, Any]) -> list[str]:
    ps = pod_spec(obj)
    if not ps:
        return []
    bad = []
    for c in [*(ps.get("initContainers") or []), *(ps.get("containers") or [])]:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if not ({"cpu", "memory"} <= set(req) and "memory" in lim):
            bad.append(f"{obj['kind']}/{obj['metadata']['name']}: container {c['name']}")
    return bad


def run_checkov(manifest_dirs: dict[str, Path], work: Path) -> list[str]:
    """Run checkov once over the manifests of several stacks (copied into one directory); returns
    the failed checks as 'stack:CHECK resource'. Skips come only from the objects' annotations."""
    combined = work / "checkov-input"
    combined.mkdir(parents=True, exist_ok=True)
    count = 0
    for stack, d in manifest_dirs.items():
        for f in d.glob("*.yaml"):
            shutil.copy(f, combined / f"{stack}--{f.name}")
            count += 1
    assert count, f"no manifests to check in {manifest_dirs}"
    proc = subprocess.run([str(CHECKOV), "-d", str(combined), "--framework", "kubernetes", "--skip-download",
                           "--quiet", "-o", "json"], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip(), f"checkov printed nothing (rc {proc.returncode}): {proc.stderr[-2000:]}"
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failures = []
    for report in reports:
        # With nothing checkov has a check for, it prints only the summary counters.
        summary = report.get("summary", report)
        assert summary["parsing_errors"] == 0, summary
        for f in report.get("results", {}).get("failed_checks", []):
            failures.append(f"{f['file_path']}: {f['check_id']} {f['check_name']} ({f['resource']})")
    return failures
