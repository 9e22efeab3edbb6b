"""Regenerate every snapshot under tests/schemas from the network (`make schemas`).

Usage (needs network and `helm` on PATH):
    python -m tools.validation.refresh                 # all charts, indexes and CRDs
    python -m tools.validation.refresh --only kueue    # the sources whose name contains "kueue"
    python -m tools.validation.refresh --list          # print the table and exit (no network)

For every chart the program installs it runs `helm pull` at the pinned version, snapshots the
unpacked chart and its packaged dependencies with tools.validation.snapshot, records what the chart
renders for each release of the plans (`--plans`, default build/plan/*.json: `make schemas` plans every
stack first) with tools.validation.chart_pods (its workloads and their pods' security needs), records the versions
the repository lists (index.yaml of a classic repository; the registry's tag list for an OCI
chart), and downloads each CRD file from its repository at the tag matching the pinned component.
Pins are read from the program's own constants, so moving a version and running this keeps the
snapshots in step; a chart or CRD snapshot that no source produces any more is deleted.

Everything that decides *what* is fetched is a pure function here (`chart_sources`, `crd_sources`,
`helm_pull_command`, `raw_url`, `oci_tags_url`, `parse_bearer_challenge`) and is tested offline.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.validation import snapshot

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "tests" / "schemas"
# GKE serves the networking.gke.io objects itself; this tag of Google's public API repository is the
# schema the program's GKENetworkParamSet and Network objects are written against.
GKE_NETWORKING_API_TAG = "v0.2.0"


@dataclass(frozen=True)
class ChartSource:
    name: str  # chart name
    version: str  # pinned version
    repo: str  # https repository URL, or oci://registry/path that holds the chart
    git: str  # GitHub owner/name where the chart's sources live (provenance)
    git_path: str  # the chart's directory in that repository
    git_ref: str = ""  # tag or commit of the release (provenance)

    @property
    def oci(self) -> bool:
        return self.repo.startswith("oci://")


@dataclass(frozen=True)
class CrdSource:
    name: str  # short label (--only matches on it)
    git: str  # GitHub owner/name
    ref: str  # tag
    paths: tuple[str, ...]  # CRD files in the repository at that tag (relative to the chart with from_chart)
    from_chart: str = ""  # instead of GitHub: the pulled chart of this name, whose files `paths` names
    kinds: tuple[str, ...] = field(default_factory=tuple)  # only these kinds (empty: every CRD in the files)


def _pins() -> dict[str, Any]:
    """The versions the program pins, read from its own modules."""
    from infra.aws import cluster, karpenter, load_balancer
    from infra.aws.node_addons import EFA_PLUGIN
    from infra.k8s import cache, gpu, health, log_shipping, mlflow, monitoring, serving, tenancy

    return {
        "karpenter": (karpenter.CHART, karpenter.CHART_VERSION),
        "karpenter-crd": (getattr(karpenter, "CRD_CHART", "oci://public.ecr.aws/karpenter/karpenter-crd"),
                          karpenter.CHART_VERSION),
        "aws-load-balancer-controller": (load_balancer.CHART_REPO, load_balancer.CHART_VERSION),
        "nvidia-device-plugin": (gpu.DEVICE_PLUGIN_REPO, gpu.DEVICE_PLUGIN_VERSION),
        "aws-efa-k8s-device-plugin": (EFA_PLUGIN.repo, EFA_PLUGIN.version),
        "kube-prometheus-stack": (monitoring.KPS_REPO, monitoring.KPS_VERSION),
        "dcgm-exporter": (monitoring.DCGM_REPO, monitoring.DCGM_VERSION),
        "alluxio": (cache.REPO, cache.CHART_VERSION),
        "kueue": (tenancy.KUEUE_CHART, tenancy.KUEUE_VERSION),
        "jobset": (tenancy.JOBSET_CHART, tenancy.JOBSET_VERSION),
        "kuberay-operator": (tenancy.KUBERAY_REPO, tenancy.KUBERAY_VERSION),
        "cloudnative-pg": (mlflow.CNPG_REPO, mlflow.CNPG_CHART_VERSION),
        "vpc-cni": (None, cluster.VPC_CNI_VERSION),
        "aws-for-fluent-bit": (log_shipping.CHART_REPO, log_shipping.CHART_VERSION),
        "node-problem-detector": (health.NPD_CHART, health.NPD_VERSION),
        "node-readiness-controller": (health.NRC_CHART, health.NRC_VERSION),
        "cert-manager": (serving.CERT_MANAGER_REPO, serving.CERT_MANAGER_VERSION),
        "kserve-crd": (serving.KSERVE_CRD_CHART, serving.KSERVE_VERSION),
        "kserve-resources": (serving.KSERVE_CHART, serving.KSERVE_VERSION),
    }


def _oci_repo(chart_ref: str) -> str:
    return chart_ref.rstrip("/").rsplit("/", 1)[0] if chart_ref.startswith("oci://") else chart_ref


def chart_sources(pins: dict[str, Any] | None = None) -> list[ChartSource]:
    """The table of charts: name, pinned version, repository, and where their sources live."""
    p = pins or _pins()
    kar_ref, kar_v = p["karpenter"]
    crd_ref, _ = p["karpenter-crd"]
    return [
        ChartSource("karpenter", kar_v, _oci_repo(kar_ref), "aws/karpenter-provider-aws", "charts/karpenter",
                    f"v{kar_v}"),
        ChartSource("karpenter-crd", kar_v, _oci_repo(crd_ref), "aws/karpenter-provider-aws", "charts/karpenter-crd",
                    f"v{kar_v}"),
        ChartSource("aws-load-balancer-controller", p["aws-load-balancer-controller"][1],
                    p["aws-load-balancer-controller"][0], "aws/eks-charts", "stable/aws-load-balancer-controller"),
        ChartSource("nvidia-device-plugin", p["nvidia-device-plugin"][1], p["nvidia-device-plugin"][0],
                    "NVIDIA/k8s-device-plugin", "deployments/helm/nvidia-device-plugin",
                    f"v{p['nvidia-device-plugin'][1]}"),
        ChartSource("aws-efa-k8s-device-plugin", p["aws-efa-k8s-device-plugin"][1], p["aws-efa-k8s-device-plugin"][0],
                    "aws/eks-charts", "stable/aws-efa-k8s-device-plugin"),
        ChartSource("kube-prometheus-stack", p["kube-prometheus-stack"][1], p["kube-prometheus-stack"][0],
                    "prometheus-community/helm-charts", "charts/kube-prometheus-stack",
                    f"kube-prometheus-stack-{p['kube-prometheus-stack'][1]}"),
        ChartSource("dcgm-exporter", p["dcgm-exporter"][1], p["dcgm-exporter"][0], "NVIDIA/dcgm-exporter",
                    "deployment"),
        ChartSource("alluxio", p["alluxio"][1], p["alluxio"][0], "Alluxio/alluxio",
                    "integration/kubernetes/helm-chart/alluxio"),
        ChartSource("kueue", p["kueue"][1], _oci_repo(p["kueue"][0]), "kubernetes-sigs/kueue", "charts/kueue",
                    f"v{p['kueue'][1]}"),
        ChartSource("jobset", p["jobset"][1], _oci_repo(p["jobset"][0]), "kubernetes-sigs/jobset", "charts/jobset",
                    f"v{p['jobset'][1]}"),
        ChartSource("kuberay-operator", p["kuberay-operator"][1], p["kuberay-operator"][0], "ray-project/kuberay",
                    "helm-chart/kuberay-operator", f"v{p['kuberay-operator'][1]}"),
        ChartSource("cloudnative-pg", p["cloudnative-pg"][1], p["cloudnative-pg"][0], "cloudnative-pg/charts",
                    "charts/cloudnative-pg", f"cloudnative-pg-v{p['cloudnative-pg'][1]}"),
        ChartSource("aws-for-fluent-bit", p["aws-for-fluent-bit"][1], p["aws-for-fluent-bit"][0], "aws/eks-charts",
                    "stable/aws-for-fluent-bit"),
        # Not installed with Helm: the EKS vpc-cni add-on's configuration values are this chart's values at the
        # add-on's version, so its snapshot is what infra/aws/cluster.py's add-on configuration is checked against.
        ChartSource("aws-vpc-cni", vpc_cni_tag(p["vpc-cni"][1]).lstrip("v"), "https://aws.github.io/eks-charts",
                    "aws/amazon-vpc-cni-k8s", "charts/aws-vpc-cni", vpc_cni_tag(p["vpc-cni"][1])),
        # deliveryhero/helm-charts tags no chart release; its index.yaml points at the OCI artifacts.
        ChartSource("node-problem-detector", p["node-problem-detector"][1], _oci_repo(p["node-problem-detector"][0]),
                    "deliveryhero/helm-charts", "stable/node-problem-detector"),
        ChartSource("node-readiness-controller", p["node-readiness-controller"][1],
                    _oci_repo(p["node-readiness-controller"][0]), "kubernetes-sigs/node-readiness-controller",
                    "charts/node-readiness-controller", f"v{p['node-readiness-controller'][1]}"),
        # Serving (infra/k8s/serving.py): installed only by stacks that serve models, which tools/variants.py
        # plans for `make schemas`; KServe tags its chart versions with the leading v.
        ChartSource("cert-manager", p["cert-manager"][1], p["cert-manager"][0], "cert-manager/cert-manager",
                    "deploy/charts/cert-manager", p["cert-manager"][1]),
        ChartSource("kserve-crd", p["kserve-crd"][1], _oci_repo(p["kserve-crd"][0]), "kserve/kserve",
                    "charts/kserve-crd", p["kserve-crd"][1]),
        ChartSource("kserve-resources", p["kserve-resources"][1], _oci_repo(p["kserve-resources"][0]),
                    "kserve/kserve", "charts/kserve-resources", p["kserve-resources"][1]),
    ]


def vpc_cni_tag(addon_version: str) -> str:
    """The amazon-vpc-cni-k8s tag of an EKS add-on version (v1.20.1-eksbuild.3 -> v1.20.1)."""
    m = re.fullmatch(r"(v\d+\.\d+\.\d+)(-eksbuild\.\d+)?", addon_version)
    if not m:
        raise ValueError(f"vpc-cni add-on version {addon_version!r} is not vX.Y.Z-eksbuild.N")
    return m.group(1)


def crd_sources(pins: dict[str, Any] | None = None) -> list[CrdSource]:
    """The table of CRDs: every kind the program creates, at the version of the component serving it."""
    p = pins or _pins()
    kueue_v, jobset_v, kar_v = p["kueue"][1], p["jobset"][1], p["karpenter"][1]
    kueue = ("clusterqueues", "localqueues", "resourceflavors", "cohorts", "workloads", "workloadpriorityclasses",
             "admissionchecks", "topologies")
    monitoring = ("alertmanagerconfigs", "alertmanagers", "podmonitors", "probes", "prometheusagents", "prometheuses",
                  "prometheusrules", "scrapeconfigs", "servicemonitors", "thanosrulers")
    return [
        CrdSource("jobset", "kubernetes-sigs/jobset", f"v{jobset_v}",
                  ("config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml",)),
        CrdSource("kueue", "kubernetes-sigs/kueue", f"v{kueue_v}",
                  tuple(f"config/components/crd/bases/kueue.x-k8s.io_{k}.yaml" for k in kueue)),
        # `gpu-train prepare --cluster` creates RayJobs, whose operator makes RayClusters; the chart ships both CRDs.
        CrdSource("kuberay", "ray-project/kuberay", f"v{p['kuberay-operator'][1]}",
                  ("crds/ray.io_rayjobs.yaml", "crds/ray.io_rayclusters.yaml"), from_chart="kuberay-operator"),
        CrdSource("karpenter", "aws/karpenter-provider-aws", f"v{kar_v}",
                  ("pkg/apis/crds/karpenter.sh_nodepools.yaml", "pkg/apis/crds/karpenter.sh_nodeclaims.yaml",
                   "pkg/apis/crds/karpenter.k8s.aws_ec2nodeclasses.yaml")),
        CrdSource("monitoring", "prometheus-community/helm-charts", f"kube-prometheus-stack-{p['kube-prometheus-stack'][1]}",
                  tuple(f"charts/crds/crds/crd-{k}.yaml" for k in monitoring), from_chart="kube-prometheus-stack"),
        CrdSource("cloudnative-pg", "cloudnative-pg/charts", f"cloudnative-pg-v{p['cloudnative-pg'][1]}",
                  ("templates/crds/crds.yaml",), from_chart="cloudnative-pg",
                  kinds=("Cluster", "Pooler", "ScheduledBackup", "Backup", "Database")),
        CrdSource("eniconfig", "aws/amazon-vpc-cni-k8s", vpc_cni_tag(p["vpc-cni"][1]),
                  ("charts/aws-vpc-cni/crds/customresourcedefinition.yaml",), kinds=("ENIConfig",)),
        CrdSource("gke-networking", "GoogleCloudPlatform/gke-networking-api", GKE_NETWORKING_API_TAG,
                  ("config/crds/networking.gke.io_gkenetworkparamsets.yaml", "config/crds/networking.gke.io_networks.yaml")),
        CrdSource("node-readiness", "kubernetes-sigs/node-readiness-controller", f"v{p['node-readiness-controller'][1]}",
                  ("config/crd/bases/readiness.node.x-k8s.io_nodereadinessrules.yaml",)),
        # The kserve-crd chart renders its ClusterStorageContainer CRD from files/ (a lookup guards the template).
        CrdSource("kserve", "kserve/kserve", p["kserve-crd"][1],
                  ("templates/serving.kserve.io_inferenceservices.yaml",
                   "files/serving.kserve.io_clusterstoragecontainers.yaml"), from_chart="kserve-crd"),
    ]


# --------------------------------------------------------------------------------------- network parts


def helm_pull_command(src: ChartSource, dest: Path) -> list[str]:
    if src.oci:
        return ["helm", "pull", f"{src.repo}/{src.name}", "--version", src.version, "--untar", "--untardir", str(dest)]
    return ["helm", "pull", src.name, "--repo", src.repo, "--version", src.version, "--untar", "--untardir", str(dest)]


def raw_url(repo: str, ref: str, path: str) -> str:
    return f"https://raw.githubusercontent.com/{repo}/{urllib.parse.quote(ref)}/{path}"


def index_url(repo: str) -> str:
    return repo.rstrip("/") + "/index.yaml"


def oci_tags_url(repo: str, chart: str) -> str:
    """The OCI distribution API's tag list for oci://<registry>/<path>/<chart>."""
    rest = repo.removeprefix("oci://").rstrip("/")
    registry, _, path = rest.partition("/")
    name = f"{path}/{chart}" if path else chart
    return f"https://{registry}/v2/{name}/tags/list"


def parse_bearer_challenge(header: str) -> dict[str, str]:
    """`WWW-Authenticate: Bearer realm="...",service="...",scope="..."` -> its parameters."""
    if not header.lower().startswith("bearer "):
        raise ValueError(f"not a Bearer challenge: {header!r}")
    return dict(re.findall(r'(\w+)="([^"]*)"', header[7:]))


def token_url(challenge: dict[str, str]) -> str:
    query = {k: v for k, v in challenge.items() if k in ("service", "scope")}
    return f"{challenge['realm']}?{urllib.parse.urlencode(query)}"


def semver_tags(tags: Iterable[str]) -> list[str]:
    """Chart versions among registry tags (x.y.z with an optional pre-release), newest first."""
    out = [t for t in tags if re.fullmatch(r"v?\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", t)]

    def key(t: str) -> tuple[Any, ...]:
        core, _, pre = t.lstrip("v").partition("-")
        return (*map(int, core.split(".")), pre == "", pre)

    return sorted(out, key=key, reverse=True)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - fixed https URLs
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def fetch_text(url: str) -> str:
    status, body, _ = _get(url)
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}")
    return body.decode()


def oci_tags(repo: str, chart: str) -> list[str]:
    url = oci_tags_url(repo, chart)
    status, body, headers = _get(url)
    if status == 401:
        challenge = parse_bearer_challenge(headers.get("WWW-Authenticate") or headers.get("www-authenticate") or "")
        _, tok_body, _ = _get(token_url(challenge))
        token = json.loads(tok_body).get("token") or json.loads(tok_body).get("access_token")
        status, body, headers = _get(url, {"Authorization": f"Bearer {token}"})
    if status != 200:
        raise RuntimeError(f"GET {url}: HTTP {status}")
    return semver_tags(json.loads(body).get("tags") or [])


# ------------------------------------------------------------------------------------------ refresh


def refresh(only: str = "", out: Path = SCHEMAS, plans: list[Path] | None = None) -> list[Path]:
    from tools.validation import chart_pods

    plan_docs = [json.loads(p.read_text()) for p in (plans if plans is not None else
                                                     sorted((ROOT / "build" / "plan").glob("*.json")))]
    if not plan_docs:
        raise RuntimeError("no plans to record the charts' workloads from: run make plans (or pass --plans)")
    if shutil.which("helm") is None:
        raise RuntimeError("helm is not on PATH (https://helm.sh/docs/intro/install/)")
    written: list[Path] = []
    charts_dir, crds_dir = out / "charts", out / "crds"
    index_path = charts_dir / "index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    pulled: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for src in chart_sources():
            if only and only not in src.name:
                continue
            dest = work / src.name
            dest.mkdir()
            subprocess.run(helm_pull_command(src, dest), check=True)
            chart_dir = dest / src.name
            pulled[src.name] = chart_dir
            source = {"repo": src.git, "ref": src.git_ref, "path": src.git_path, "chart": src.repo,
                      "version": src.version}
            chart_written = snapshot.write_chart_snapshots(chart_dir, charts_dir, source, work / f"{src.name}-deps")
            pods = chart_pods.record(chart_dir, plan_docs, chart_pods.kube_versions())
            if pods is not None:  # a chart the program installs with Helm (not the vpc-cni add-on's)
                top = json.loads(chart_written[0].read_text())
                top["pods"] = pods
                snapshot.write_json(top, chart_written[0])
            written += chart_written
            if src.oci:
                versions = {src.name: oci_tags(src.repo, src.name)}
                how = {"from": "registry tags", "url": oci_tags_url(src.repo, src.name)}
            else:
                versions = snapshot.index_versions(fetch_text(index_url(src.repo)), [src.name], index_url(src.repo))
                how = {"from": "index.yaml", "url": index_url(src.repo)}
            index = snapshot.merge_index(index, src.repo, versions, how)
        if index is not None:
            written.append(snapshot.write_json(index, index_path))
        for crd in crd_sources():
            if only and only not in crd.name:
                continue
            for path in crd.paths:
                if crd.from_chart:
                    if crd.from_chart not in pulled:
                        raise RuntimeError(f"CRDs {crd.name} come from chart {crd.from_chart}: refresh it too")
                    local = pulled[crd.from_chart] / path
                    text, origin = local.read_text(), str(local)
                    chart = next(c for c in chart_sources() if c.name == crd.from_chart)
                    source = {"repo": chart.git, "ref": chart.git_ref, "path": f"{chart.git_path}/{path}",
                              "chart": chart.repo, "version": chart.version}
                else:
                    origin = raw_url(crd.git, crd.ref, path)
                    text = fetch_text(origin)
                    source = {"repo": crd.git, "ref": crd.ref, "path": path}
                for snap in snapshot.crd_snapshots(text, source, origin):
                    if crd.kinds and snap["names"]["kind"] not in crd.kinds:
                        continue
                    written.append(snapshot.write_json(snap, crds_dir / snapshot.crd_snapshot_name(snap)))
    if not only:
        keep = {p.resolve() for p in written}
        for stale in [*charts_dir.glob("*.json"), *crds_dir.glob("*.json")]:
            if stale.resolve() not in keep:
                stale.unlink()
                print(f"removed {stale}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.validation.refresh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="refresh only sources whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the table of sources and exit")
    parser.add_argument("--out", type=Path, default=SCHEMAS)
    parser.add_argument("--plans", type=Path, nargs="*", help="plan JSON files (default: build/plan/*.json)")
    args = parser.parse_args(argv)
    if args.list:
        for src in chart_sources():
            print(f"chart {src.name} {src.version}  {src.repo}  ({src.git} {src.git_ref or '-'} {src.git_path})")
        for crd in crd_sources():
            where = f"chart {crd.from_chart}" if crd.from_chart else crd.git
            print(f"crds  {crd.name} {crd.ref}  {where}: {', '.join(crd.paths)}")
        return 0
    try:
        for path in refresh(args.only, args.out, args.plans):
            print(path)
    except (RuntimeError, OSError, subprocess.CalledProcessError, snapshot.SnapshotError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
