"""Record what each pinned chart renders: its workloads, their namespaces and their pods' security needs.

Usage (needs `helm`; `make schemas` runs it for every chart it pulls, with the plans `make plans` wrote):
    python -m tools.validation.chart_pods CHART_DIR build/plan/*.json --snapshot tests/schemas/charts/<chart>-<version>.json

For every release of the plans that installs this chart at this version, it runs `helm template` on the
unpacked chart (dependencies included) with exactly the values, release name and namespace the plan records,
and keeps, per workload (Pod, Deployment, DaemonSet, StatefulSet, ReplicaSet, Job, CronJob), its kind, name,
the template it came from, the namespace it is put in (null: the release's), the stacks it was rendered for
and each pod's security skeleton (tools.validation.pod_security.skeleton: host namespaces, hostPath volumes, host ports,
capabilities, privileged, user, seccomp and the rest Pod Security reads). Renders are grouped by the shape
of the values (`values_shape`) and written under `pods` in the chart's snapshot; the plan-time admission
check (tools/validation/admission.py) reads them back for a release whose values have a recorded shape.

The shape of a values tree is every key path (list items as `[]`) with its value's type, except that
booleans and the strings under keys in SHAPE_STRING_KEYS keep their value: those switch workloads and host
access on and off (`hostNetwork: true`, `fuse.enabled`) and place them (`namespaceOverride`, a volume's
`type: hostPath`). A changed number or other string (a resource size, an image tag, a path) keeps the shape,
so the recorded needs stand; the `charts` CI job renders the exact values again and evaluates every pod.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tools.validation import helm, pod_security

GENERATOR = "tools.validation.chart_pods/1"
SHAPE_STRING_KEYS = frozenset({"namespace", "namespaceOverride", "type"})
WORKLOAD_KINDS = frozenset(pod_security.TEMPLATE_PATHS) - {"JobSet"}


def values_shape(values: Any, path: str = "") -> list[str]:
    """`path: type` lines for every leaf and container of a values tree, sorted and without duplicates."""
    lines: set[str] = set()

    def walk(node: Any, where: str, key: str) -> None:
        if isinstance(node, Mapping):
            lines.add(f"{where or '.'}: object")
            for k, v in node.items():
                walk(v, f"{where}.{k}" if where else str(k), str(k))
        elif isinstance(node, list):
            lines.add(f"{where}: array")
            for item in node:
                walk(item, f"{where}[]", key)
        elif isinstance(node, bool):
            lines.add(f"{where}: {str(node).lower()}")
        elif isinstance(node, str) and key in SHAPE_STRING_KEYS:
            lines.add(f"{where}: {json.dumps(node)}")
        else:
            lines.add(f"{where}: {_type(node)}")

    walk(values, path, "")
    return sorted(lines)


def _type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    return "string"


def shape_id(lines: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def template_command(chart_dir: Path, release: helm.Release, values_file: Path, kube_version: str,
                     apis: Sequence[str], helm_bin: str = "helm") -> list[str]:
    cmd = [helm_bin, "template", release.name, str(chart_dir), "--namespace", release.namespace or "default",
           "--values", str(values_file), "--kube-version", kube_version, "--skip-tests"]
    for api in apis:
        cmd += ["--api-versions", api]
    return cmd


def workloads(manifest: str) -> list[dict[str, Any]]:
    """The workloads of a rendered manifest, each with its pods' skeletons (Helm's `# Source:` names the
    template, under its subchart's path)."""
    out = []
    for text in manifest.split("\n---"):
        source = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("# Source:")), "")
        doc = yaml.safe_load(text)
        if not isinstance(doc, dict) or doc.get("kind") not in WORKLOAD_KINDS:
            continue
        meta = doc.get("metadata") or {}
        out.append({"kind": doc["kind"], "name": meta.get("name"), "namespace": meta.get("namespace"),
                    "source": source,
                    "pods": [{"where": where, "pod": pod_security.skeleton(pod)}
                             for where, pod in pod_security.pod_templates(doc)]})
    return out


def render(chart_dir: Path, release: helm.Release, kube_version: str, apis: Sequence[str],
           helm_bin: str = "helm") -> list[dict[str, Any]]:
    """The workloads of one release as `helm template` renders it; a render failure raises, naming it."""
    with tempfile.TemporaryDirectory() as tmp:
        values_file = Path(tmp) / "values.yaml"
        values_file.write_text(yaml.safe_dump(dict(release.values), sort_keys=True))
        proc = subprocess.run(template_command(chart_dir, release, values_file, kube_version, apis, helm_bin),
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{release.label}: helm template failed: {proc.stderr.strip()[-2000:]}")
    found = workloads(proc.stdout)
    for w in found:
        if w["namespace"] == release.namespace:
            w["namespace"] = None  # the release's own namespace, wherever the release is installed
    return found


def plan_releases(plans: Sequence[Mapping[str, Any]], chart: str, version: str) -> list[tuple[str, helm.Release]]:
    """(stack, release) for each release of the plans that installs this chart at this version."""
    return [(str(plan.get("stack")), rel) for plan in plans for rel in helm.releases(plan)
            if rel.chart_name == chart and rel.version == version]


def record(chart_dir: Path, plans: Sequence[Mapping[str, Any]], kube_version: Callable[[str], str],
           helm_bin: str = "helm") -> dict[str, Any] | None:
    """The `pods` section of a chart's snapshot: one entry per values shape, with the stacks that have it and
    the workloads the chart renders for them (`kube_version(stack)` gives the --kube-version). None when no
    plan installs this chart at this version."""
    from tools.validation.cluster import api_versions

    meta = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    found = plan_releases(plans, str(meta["name"]), str(meta["version"]))
    if not found:
        return None
    apis = api_versions()
    renders: dict[str, dict[str, Any]] = {}
    for stack, release in found:
        lines = values_shape(release.values)
        entry = renders.setdefault(shape_id(lines), {"shape": shape_id(lines), "valuesShape": lines,
                                                     "stacks": [], "workloads": []})
        entry["stacks"] = sorted({*entry["stacks"], stack})
        for w in render(chart_dir, release, kube_version(stack), apis, helm_bin):
            same = next((x for x in entry["workloads"] if {**x, "stacks": None} == {**w, "stacks": None}), None)
            if same is None:
                entry["workloads"].append({**w, "stacks": [stack]})
            else:
                same["stacks"] = sorted({*same["stacks"], stack})
    return {"generator": GENERATOR, "renders": sorted(renders.values(), key=lambda r: r["stacks"])}


def kube_versions(default: str = "") -> Callable[[str], str]:
    """A stack's Kubernetes version from stacks/Pulumi.<stack>.yaml, or `default` for a stack without a file
    there (a variant planned from another file)."""
    from tools.validation.cluster import ROOT, stack_kube_version

    def of(stack: str) -> str:
        if (ROOT / "stacks" / f"Pulumi.{stack}.yaml").is_file() or not default:
            return stack_kube_version(stack)
        return default
    return of


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.validation.chart_pods", description=__doc__.split("\n\n")[0])
    parser.add_argument("chart_dir", type=Path, help="an unpacked chart, dependencies under charts/")
    parser.add_argument("plans", type=Path, nargs="+", help="plan JSON files written by python -m infra.plan")
    parser.add_argument("--snapshot", type=Path, required=True, help="the chart's snapshot to write `pods` into")
    parser.add_argument("--helm", default="helm")
    parser.add_argument("--kube-version", default="", help="for stacks without a file in stacks/ (x.y.z)")
    args = parser.parse_args(argv)
    plans = [json.loads(p.read_text()) for p in args.plans]
    try:
        pods = record(args.chart_dir, plans, kube_versions(args.kube_version), args.helm)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if pods is None:
        print(f"error: no plan installs the chart in {args.chart_dir}", file=sys.stderr)
        return 2
    snap = json.loads(args.snapshot.read_text())
    snap["pods"] = pods
    args.snapshot.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    print(f"{args.snapshot}: {len(pods['renders'])} values shapes, "
          f"{sum(len(r['workloads']) for r in pods['renders'])} workloads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
