"""Render every Helm release of a plan with the real chart, and write kubeconform schemas for the CRDs.

Usage (the `charts` job of .github/workflows/ci.yml; needs network and helm):
    python -m tools.validation.releases template build/plan/*.json --out build/rendered
    python -m tools.validation.releases schemas --out build/kubeconform-schemas
    python -m tools.validation.releases kube-version aws-dev          # 1.33.0
    kubeconform -strict -summary -kubernetes-version 1.33.0 -schema-location default \\
        -schema-location 'build/kubeconform-schemas/{{.Group}}/{{.ResourceKind}}_{{.ResourceAPIVersion}}.json' \\
        build/rendered/manifests/aws-dev

`template` writes `values/<stack>/<release>.yaml` (exactly the values the plan records) and, under
`manifests/<stack>/`, `<release>.yaml` (what `helm template` renders from the chart repository at the
pinned version, with the release's namespace, CRD and API-version context) and
`custom-resources.yaml` (the plan's custom resources); then it evaluates every pod each release renders
against its namespace's Pod Security level and the team namespaces' admission policies (the plan-time
check, tools/validation/admission.py, on the real render instead of the snapshot's record), and fails
listing every release that did not render and every pod admission would refuse. `schemas` turns each CRD
snapshot of tests/schemas/crds into the JSON schema kubeconform reads, with the same translation
the offline check uses (tools.validation.crd.to_jsonschema: unknown fields rejected, int-or-string,
nullable, embedded resources). The pure parts (`template_command`, `values_yaml`, `api_versions`,
`kubeconform_schemas`) are tested offline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tools.validation import admission, chart_pods, crd, helm
from tools.validation.cluster import api_versions, stack_kube_version

JSON_SCHEMA_DRAFT4 = "http://json-schema.org/draft-04/schema#"


def values_yaml(values: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(values), sort_keys=True, default_flow_style=False)


def template_command(release: helm.Release, values_file: Path, kube_version: str, apis: list[str],
                     skip_crds: bool = False, helm_bin: str = "helm") -> list[str]:
    """The `helm template` invocation that renders a release as `pulumi up` would install it."""
    cmd = [helm_bin, "template", release.name]
    if release.chart.startswith("oci://"):
        cmd.append(release.chart)
    else:
        cmd += [release.chart, "--repo", release.repo or ""]
    cmd += ["--version", release.version, "--namespace", release.namespace or "default", "--values", str(values_file),
            "--kube-version", kube_version, "--skip-tests"]
    cmd.append("--skip-crds" if skip_crds else "--include-crds")
    for api in apis:
        cmd += ["--api-versions", api]
    return cmd


def _skip_crds(plan: Mapping[str, Any], release: helm.Release) -> bool:
    for res in plan.get("resources") or []:
        inputs = res.get("inputs") or {}
        if res.get("type") == helm.RELEASE_TYPE and inputs.get("name") == release.name:
            return bool(inputs.get("skipCrds"))
    return False


def kubeconform_schemas(snapshots: crd.Snapshots | None = None) -> dict[str, dict[str, Any]]:
    """Relative path ({group}/{kind lowercased}_{version}.json, kubeconform's layout) -> JSON schema."""
    snaps = snapshots or crd.Snapshots()
    out = {}
    for (group, kind), doc in snaps.by_kind().items():
        for version, data in doc["versions"].items():
            if not data.get("served"):
                continue
            schema = crd.to_jsonschema(data["schema"], root=True)
            schema["$schema"] = JSON_SCHEMA_DRAFT4
            out[f"{group}/{kind.lower()}_{version}.json"] = schema
    return out


def rendered_admission_problems(plan: Mapping[str, Any], release: helm.Release, manifest: str) -> list[str]:
    """What admission would refuse among the pods of one release as `helm template` rendered it: each
    workload against its namespace's level (the plan's labels, else the cluster's default) and policies."""
    version = admission.kube_version(str(plan.get("stack")))
    known = admission.namespaces(plan, version)
    policies = admission.Policies(admission.policy_objects(plan))
    label = f"release {release.namespace}/{release.name} ({release.chart_name} {release.version}, rendered)"
    problems = []
    for w in chart_pods.workloads(manifest):
        ns_name = w["namespace"] or release.namespace or "default"
        ns = known.get(ns_name) or admission.Namespace(ns_name, admission.DEFAULT_LEVEL, version, {}, False)
        workload = admission.Workload(label, w["kind"], w["name"], ns_name,
                                      tuple((p["where"], p["pod"]) for p in w["pods"]))
        problems += admission.judge(workload, ns, policies)
    return problems


def template(plans: list[Path], out: Path, helm_bin: str = "helm") -> list[str]:
    """Render every release of every plan and judge its pods; returns the failures (one line each)."""
    failures = []
    apis = api_versions()
    for plan_path in plans:
        plan = json.loads(plan_path.read_text())
        stack = plan["stack"]
        kube_version = stack_kube_version(stack)
        stack_dir = out / "manifests" / stack
        values_dir = out / "values" / stack
        stack_dir.mkdir(parents=True, exist_ok=True)
        values_dir.mkdir(parents=True, exist_ok=True)
        for rel in helm.releases(plan):
            values_file = values_dir / f"{rel.name}.yaml"
            values_file.write_text(values_yaml(rel.values))
            cmd = template_command(rel, values_file, kube_version, apis, _skip_crds(plan, rel), helm_bin)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                failures.append(f"{stack}: {rel.label}: helm template failed: {proc.stderr.strip()[-2000:]}")
                continue
            (stack_dir / f"{rel.name}.yaml").write_text(proc.stdout)
            failures += [f"{stack}: {p}" for p in rendered_admission_problems(plan, rel, proc.stdout)]
        objects = crd.custom_resources(plan)
        (stack_dir / "custom-resources.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.validation.releases", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("template", help="render every release of the plans with helm template")
    t.add_argument("plans", type=Path, nargs="+")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--helm", default="helm", help="the helm binary")
    s = sub.add_parser("schemas", help="write kubeconform schemas from the CRD snapshots")
    s.add_argument("--out", type=Path, required=True)
    k = sub.add_parser("kube-version", help="print a stack's Kubernetes version (x.y.0)")
    k.add_argument("stack")
    args = parser.parse_args(argv)
    if args.what == "kube-version":
        print(stack_kube_version(args.stack))
        return 0
    if args.what == "schemas":
        for rel_path, schema in sorted(kubeconform_schemas().items()):
            path = args.out / rel_path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(schema, indent=1, sort_keys=True))
        print(f"wrote {len(kubeconform_schemas())} schemas under {args.out}")
        return 0
    failures = template(args.plans, args.out, args.helm)
    for f in failures:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
