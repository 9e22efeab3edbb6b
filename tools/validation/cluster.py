"""What a stack's cluster offers a chart when it is rendered: its Kubernetes version and the API versions served.

Usage:
    stack_kube_version("aws-dev")   # "1.33.0": the stack's gpu-train:cluster.kubernetesVersion as x.y.0
    api_versions()                  # every group/version (and group/version/Kind) the CRD snapshots serve

Shared by the release renderer (releases.py) and the checks over what charts render (chart_pods.py, admission.py).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tools.validation import crd

ROOT = Path(__file__).resolve().parents[2]


def stack_kube_version(stack: str, stacks_dir: Path = ROOT / "stacks") -> str:
    """The stack's Kubernetes minor version (gpu-train:cluster.kubernetesVersion) as x.y.0."""
    path = stacks_dir / f"Pulumi.{stack}.yaml"
    doc = yaml.safe_load(path.read_text()) or {}
    version = str(((doc.get("config") or {}).get("gpu-train:cluster") or {}).get("kubernetesVersion") or "")
    if not version:
        raise ValueError(f"{path}: gpu-train:cluster.kubernetesVersion is not set")
    return version if version.count(".") >= 2 else f"{version}.0"


def api_versions(snapshots: crd.Snapshots | None = None) -> list[str]:
    """`group/version` and `group/version/Kind` of every served CRD version: the API versions a
    chart may ask `.Capabilities.APIVersions.Has` for (the cluster serves them once the CRDs exist)."""
    snaps = snapshots or crd.Snapshots()
    out = set()
    for (group, kind), doc in snaps.by_kind().items():
        for version, data in doc["versions"].items():
            if data.get("served"):
                out.add(f"{group}/{version}")
                out.add(f"{group}/{version}/{kind}")
    return sorted(out)
