"""`make schemas` (tools/validation/refresh.py): the table of sources follows the program's pins, the
snapshots under tests/schemas are exactly what that table produces, and the network parts are built
right. The refresh itself needs helm and the network, so only its pure parts run here.

Usage: .venv/bin/pytest tests/tools/validation/test_refresh.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infra.aws import karpenter
from infra.aws.node_addons import EFA_PLUGIN
from infra.k8s import cache, gpu, mlflow, monitoring, tenancy
from tests.conftest import ROOT
from tools.validation import refresh, snapshot

SCHEMAS = ROOT / "tests" / "schemas"


def test_the_table_reads_the_program_pins():
    table = {s.name: s for s in refresh.chart_sources()}
    assert (table["kube-prometheus-stack"].version, table["kube-prometheus-stack"].repo) == (
        monitoring.KPS_VERSION, monitoring.KPS_REPO)
    assert table["dcgm-exporter"].version == monitoring.DCGM_VERSION
    assert table["nvidia-device-plugin"].version == gpu.DEVICE_PLUGIN_VERSION
    assert (table["aws-efa-k8s-device-plugin"].version, table["aws-efa-k8s-device-plugin"].repo) == (
        EFA_PLUGIN.version, EFA_PLUGIN.repo)
    assert (table["alluxio"].version, table["alluxio"].repo) == (cache.CHART_VERSION, cache.REPO)
    assert table["cloudnative-pg"].version == mlflow.CNPG_CHART_VERSION
    assert (table["kueue"].version, table["kueue"].repo) == (tenancy.KUEUE_VERSION, "oci://registry.k8s.io/kueue/charts")
    assert table["karpenter"].version == karpenter.CHART_VERSION
    crds = {c.name: c for c in refresh.crd_sources()}
    assert crds["kueue"].ref == f"v{tenancy.KUEUE_VERSION}" and crds["jobset"].ref == f"v{tenancy.JOBSET_VERSION}"
    assert crds["monitoring"].from_chart == "kube-prometheus-stack"
    assert (table["kuberay-operator"].version, table["kuberay-operator"].repo) == (tenancy.KUBERAY_VERSION,
                                                                                  tenancy.KUBERAY_REPO)
    assert (crds["kuberay"].from_chart, crds["kuberay"].ref) == ("kuberay-operator", f"v{tenancy.KUBERAY_VERSION}")


def test_every_chart_snapshot_is_one_the_table_produces_at_its_pinned_version():
    table = refresh.chart_sources()
    wanted = {f"{s.name}-{s.version}.json" for s in table}
    docs = {p.name: json.loads(p.read_text()) for p in (SCHEMAS / "charts").glob("*.json") if p.name != "index.json"}
    assert wanted <= set(docs), sorted(wanted - set(docs))
    # The others are dependencies packaged with a pinned chart, at the version it declares.
    for name, doc in docs.items():
        assert doc["generator"] == snapshot.GENERATOR and doc["kind"] == "chart"
        if name in wanted:
            src = next(s for s in table if f"{s.name}-{s.version}.json" == name)
            assert (doc["source"]["repo"], doc["source"]["version"]) == (src.git, src.version)
            continue
        parents = [d for d in docs.values() if any(
            dep["name"] == doc["chart"] and (dep.get("version") == doc["version"] or "*" in dep.get("version", ""))
            for dep in d["dependencies"])]
        assert parents, f"{name} is neither pinned nor a dependency of a pinned chart"


def test_every_crd_snapshot_comes_from_the_table_and_holds_no_prose():
    refs = {(c.git, c.ref) for c in refresh.crd_sources()}
    charts = {(s.git, s.git_ref) for s in refresh.chart_sources()}
    files = sorted((SCHEMAS / "crds").glob("*.json"))
    assert len(files) >= 25
    for path in files:
        doc = json.loads(path.read_text())
        assert (doc["source"]["repo"], doc["source"]["ref"]) in refs | charts, path.name
        assert path.name == snapshot.crd_snapshot_name(doc)

        for version in doc["versions"].values():
            _no_prose(version["schema"], path.name)


def _no_prose(schema, where: str) -> None:
    if isinstance(schema, dict):
        # A property may be called description or title (its schema is then a dict); prose is a string.
        for prose in ("description", "title"):
            assert not isinstance(schema.get(prose), str), where
        for rule in schema.get("x-kubernetes-validations") or []:
            assert set(rule) <= {"rule", "reason", "fieldPath", "optionalOldSelf"}, where
        for k, v in schema.items():
            _no_prose(v, f"{where}/{k}")
    elif isinstance(schema, list):
        for v in schema:
            _no_prose(v, where)


def test_the_index_lists_every_pinned_chart_or_says_why_not():
    repos = json.loads((SCHEMAS / "charts" / "index.json").read_text())["repositories"]
    for src in refresh.chart_sources():
        entry = repos[src.repo]
        assert entry.get("unverified") or src.version in entry["charts"][src.name], src


def test_network_parts_are_built_right():
    src = next(s for s in refresh.chart_sources() if s.name == "kueue")
    assert refresh.helm_pull_command(src, ROOT / "x")[:4] == ["helm", "pull", "oci://registry.k8s.io/kueue/charts/kueue",
                                                              "--version"]
    kps = next(s for s in refresh.chart_sources() if s.name == "kube-prometheus-stack")
    assert refresh.helm_pull_command(kps, ROOT / "x")[2:5] == ["kube-prometheus-stack", "--repo", monitoring.KPS_REPO]
    assert refresh.raw_url("kubernetes-sigs/kueue", "v0.19.2", "a/b.yaml") == \
        "https://raw.githubusercontent.com/kubernetes-sigs/kueue/v0.19.2/a/b.yaml"
    assert refresh.index_url("https://aws.github.io/eks-charts/") == "https://aws.github.io/eks-charts/index.yaml"
    assert refresh.oci_tags_url("oci://public.ecr.aws/karpenter", "karpenter") == \
        "https://public.ecr.aws/v2/karpenter/karpenter/tags/list"
    assert refresh.oci_tags_url("oci://registry.k8s.io/kueue/charts", "kueue") == \
        "https://registry.k8s.io/v2/kueue/charts/kueue/tags/list"
    challenge = refresh.parse_bearer_challenge(
        'Bearer realm="https://public.ecr.aws/token/",service="public.ecr.aws",scope="aws"')
    assert challenge == {"realm": "https://public.ecr.aws/token/", "service": "public.ecr.aws", "scope": "aws"}
    assert refresh.token_url(challenge) == "https://public.ecr.aws/token/?service=public.ecr.aws&scope=aws"
    with pytest.raises(ValueError, match="not a Bearer challenge"):
        refresh.parse_bearer_challenge('Basic realm="x"')
    assert refresh.semver_tags(["v1.2.0", "latest", "1.10.0", "1.2.0-rc.1", "sha256-abc.sig", "1.9.3"]) == [
        "1.10.0", "1.9.3", "v1.2.0", "1.2.0-rc.1"]
    assert refresh.vpc_cni_tag("v1.20.1-eksbuild.3") == "v1.20.1"
    with pytest.raises(ValueError, match="vpc-cni add-on version"):
        refresh.vpc_cni_tag("latest")


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.validation.refresh", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)


def test_list_needs_no_network_and_a_refresh_without_helm_fails_in_one_line(tmp_path):
    listed = _run("--list")
    assert listed.returncode == 0 and "chart kube-prometheus-stack" in listed.stdout and "crds  kueue" in listed.stdout
    env = {**os.environ, "PATH": str(tmp_path)}  # no helm on PATH
    plan = tmp_path / "aws-dev.json"  # a plan to record from, so the one thing missing is helm
    plan.write_text(json.dumps({"project": "gpu-train", "stack": "aws-dev", "resources": [], "outputs": {}}))
    failed = _run("--out", str(tmp_path / "out"), "--plans", str(plan), env=env)
    assert failed.returncode == 2
    assert failed.stderr.strip() == "error: helm is not on PATH (https://helm.sh/docs/intro/install/)"
    assert not (tmp_path / "out").exists()
