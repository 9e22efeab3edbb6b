"""The CI job's extraction of releases and values from plan JSON (tools/validation/releases.py), and
the kubeconform schemas it writes from the CRD snapshots. helm itself is replaced by a stand-in
script here; the `charts` CI job runs the real one against the chart repositories.

Usage: .venv/bin/pytest tests/tools/validation/test_releases.py -q
"""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path

import jsonschema
import yaml

from tools.validation import cluster, crd, helm, releases

PLAN = {
    "stack": "aws-dev",
    "resources": [
        {"type": helm.RELEASE_TYPE, "name": "tenancy-kueue", "inputs": {
            "name": "kueue", "chart": "oci://registry.k8s.io/kueue/charts/kueue", "version": "0.19.2",
            "namespace": "kueue-system", "values": {"controllerManager": {"replicas": 1}}, "skipCrds": True}},
        {"type": helm.RELEASE_TYPE, "name": "monitoring", "inputs": {
            "name": "kube-prometheus-stack", "chart": "kube-prometheus-stack", "version": "88.5.3",
            "namespace": "monitoring", "repositoryOpts": {"repo": "https://prometheus-community.github.io/helm-charts"},
            "values": {"grafana": {"adminPassword": "[secret]"}, "crds": {"enabled": True}}}},
        {"type": "kubernetes:monitoring.coreos.com/v1:ServiceMonitor", "inputs": {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": "m", "namespace": "monitoring"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"port": "metrics"}]}}},
    ],
}


def test_template_command_renders_like_an_install():
    kueue, kps = helm.releases(PLAN)
    cmd = releases.template_command(kueue, Path("v.yaml"), "1.33.0", ["a/v1", "a/v1/K"], skip_crds=True)
    assert cmd == ["helm", "template", "kueue", "oci://registry.k8s.io/kueue/charts/kueue", "--version", "0.19.2",
                   "--namespace", "kueue-system", "--values", "v.yaml", "--kube-version", "1.33.0", "--skip-tests",
                   "--skip-crds", "--api-versions", "a/v1", "--api-versions", "a/v1/K"]
    cmd = releases.template_command(kps, Path("v.yaml"), "1.33.0", [])
    assert cmd[2:6] == ["kube-prometheus-stack", "kube-prometheus-stack", "--repo",
                        "https://prometheus-community.github.io/helm-charts"]
    assert "--include-crds" in cmd


def test_values_files_hold_exactly_the_recorded_values():
    _, kps = helm.releases(PLAN)
    assert yaml.safe_load(releases.values_yaml(kps.values)) == PLAN["resources"][1]["inputs"]["values"]


def test_api_versions_cover_every_served_crd_version():
    apis = cluster.api_versions()
    assert {"monitoring.coreos.com/v1", "monitoring.coreos.com/v1/ServiceMonitor", "karpenter.sh/v1/NodePool",
            "jobset.x-k8s.io/v1alpha2/JobSet"} <= set(apis)


def test_kubeconform_schemas_are_strict_and_laid_out_as_kubeconform_reads_them():
    schemas = releases.kubeconform_schemas()
    schema = schemas["monitoring.coreos.com/servicemonitor_v1.json"]
    assert schema["$schema"] == releases.JSON_SCHEMA_DRAFT4
    assert {"kueue.x-k8s.io/clusterqueue_v1beta2.json", "crd.k8s.amazonaws.com/eniconfig_v1alpha1.json",
            "networking.gke.io/gkenetworkparamset_v1.json"} <= set(schemas)
    monitor = copy.deepcopy(PLAN["resources"][2]["inputs"])
    jsonschema.Draft4Validator(schema).validate(monitor)
    monitor["spec"]["endpoint"] = [{"port": "metrics"}]  # misspelt: kubeconform -strict must reject it
    errors = list(jsonschema.Draft4Validator(schema).iter_errors(monitor))
    assert [e.validator for e in errors] == ["additionalProperties"]


def test_stack_kube_version_comes_from_the_stack_file(capsys):
    assert cluster.stack_kube_version("aws-dev") == "1.33.0"
    assert releases.main(["kube-version", "gcp-prod"]) == 0 and capsys.readouterr().out.strip() == "1.33.0"


def test_template_writes_values_renders_and_custom_resources_and_collects_failures(tmp_path):
    plan_path = tmp_path / "aws-dev.json"
    plan_path.write_text(json.dumps(PLAN))
    fake_helm = tmp_path / "helm"
    # Stands in for helm: echoes its arguments as a manifest, fails for the OCI chart.
    fake_helm.write_text("#!/bin/sh\ncase \"$3\" in oci://*) echo 'Error: pull denied' >&2; exit 1;; esac\n"
                         "printf 'kind: ConfigMap\\nargs: \"%s\"\\n' \"$*\"\n")
    fake_helm.chmod(fake_helm.stat().st_mode | stat.S_IEXEC)
    failures = releases.template([plan_path], tmp_path / "out", str(fake_helm))
    assert failures == ["aws-dev: release kueue (kueue 0.19.2): helm template failed: Error: pull denied"]
    out = tmp_path / "out" / "manifests" / "aws-dev"
    values = tmp_path / "out" / "values" / "aws-dev" / "kueue.yaml"
    assert yaml.safe_load(values.read_text()) == {"controllerManager": {"replicas": 1}}
    rendered = yaml.safe_load((out / "kube-prometheus-stack.yaml").read_text())
    assert "--values" in rendered["args"] and "--kube-version 1.33.0" in rendered["args"]
    assert not (out / "kueue.yaml").exists()
    (cr,) = yaml.safe_load_all((out / "custom-resources.yaml").read_text())
    assert cr["kind"] == "ServiceMonitor" and crd.validate(cr).problems == []


def test_the_ci_charts_job_renders_and_validates_with_pinned_checked_tools():
    from tests.conftest import ROOT

    doc = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    job = doc["jobs"]["charts"]
    env = job["env"]
    assert env["HELM_VERSION"].startswith("v") and len(env["HELM_SHA256"]) == 64
    assert env["KUBECONFORM_VERSION"].startswith("v") and len(env["KUBECONFORM_SHA256"]) == 64
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert runs.count("sha256sum -c -") == 2
    assert "make plans" in runs
    assert "python -m tools.validation.releases template build/plan/*.json --out build/rendered" in runs
    assert "python -m tools.validation.releases schemas --out build/kubeconform-schemas" in runs
    assert "kubeconform -strict" in runs and "-ignore-missing-schemas" not in runs
    assert "build/kubeconform-schemas/{{.Group}}/{{.ResourceKind}}_{{.ResourceAPIVersion}}.json" in runs
    # The schema layout the job names is the one `schemas` writes.
    assert "monitoring.coreos.com/servicemonitor_v1.json" in releases.kubeconform_schemas()


def test_template_fails_on_a_rendered_pod_its_namespace_refuses(tmp_path):
    """The CI job judges the pods helm really renders: a host-network DaemonSet in a `baseline` namespace is
    refused, naming the release, the workload, the level and the field; in a `privileged` namespace it passes."""
    daemonset = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "exporter", "namespace": "agents"},
                 "spec": {"template": {"spec": {"hostNetwork": True, "containers": [
                     {"name": "e", "ports": [{"name": "metrics", "containerPort": 9100}]}]}}}}
    fake_helm = tmp_path / "helm"
    fake_helm.write_text("#!/bin/sh\nprintf '%s\\n' '---' '# Source: exporter/templates/ds.yaml' '"
                         + json.dumps(daemonset) + "'\n")
    fake_helm.chmod(fake_helm.stat().st_mode | stat.S_IEXEC)

    def run(level: str) -> list[str]:
        plan = copy.deepcopy(PLAN)
        plan["resources"] = plan["resources"][1:2] + [{"type": "kubernetes:core/v1:Namespace", "name": "ns", "inputs": {
            "metadata": {"name": "agents", "labels": {"pod-security.kubernetes.io/enforce": level}}}}]
        path = tmp_path / f"{level}.json"
        path.write_text(json.dumps(plan))
        return releases.template([path], tmp_path / level, str(fake_helm))

    assert run("privileged") == []
    failures = run("baseline")
    head = ("aws-dev: release monitoring/kube-prometheus-stack (kube-prometheus-stack 88.5.3, rendered): DaemonSet "
            "agents/exporter (spec.template): namespace agents enforces Pod Security 'baseline', which refuses")
    assert failures == [f"{head} host namespaces [hostNamespaces]: spec.hostNetwork=true",
                        f"{head} host ports [hostPorts]: spec.containers[e].ports[metrics].hostPort=9100"]
