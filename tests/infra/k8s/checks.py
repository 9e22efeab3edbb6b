"""Checks shared by the Kubernetes-layer tests: strict schema validation, custom resources against
their CRDs, containers' resources, and checkov over a directory of manifests.

Usage: `problems = cr_problems(obj)`; `selector_matches(selector, labels)`; `failures = run_checkov(dir)`; `validate_strict(objs, "1.33")`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate

from infra.k8s.monitoring import release_labels
from tools.validation import crd


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels + In/NotIn/Exists/DoesNotExist)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": labels.get(key) not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


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
    """A custom resource against its CRD at the pinned version (tools.validation.crd: structural
    schema, defaults, CEL rules), plus what the platform itself needs of it: monitors and rules the
    kube-prometheus-stack Prometheus selects, flavors that select their pool's nodes."""
    kind = obj.get("kind")
    meta = obj.get("metadata") or {}
    where = f"{kind}/{meta.get('name')}"
    p = [f"{where}: {problem}" for problem in crd.validate(obj).problems]
    if kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        _need(selector_matches({"matchLabels": release_labels()}, meta.get("labels") or {}), p, where,
              "labels selected by the kube-prometheus-stack Prometheus")
    elif kind == "ResourceFlavor":
        _need(bool((obj.get("spec") or {}).get("nodeLabels")), p, where, "spec.nodeLabels")
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
