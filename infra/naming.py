"""Names, tags and labels: the one place they are made.

Usage: `naming.resource_name(cfg, "vpc")` -> "gpu-train-aws-dev-vpc";
`naming.common_tags(cfg)` -> tags for every taggable resource (AWS tags, GCP labels).

Kubernetes names that several layers share (namespaces, service accounts, the monitoring release)
live here too, so the cloud layer can bind workload identities to exactly the service accounts the
Kubernetes layer creates.
"""

from __future__ import annotations

import re

from infra.config import PROJECT, StackConfig

# Labels every GPU node carries (set by the cloud layer, read by the Kubernetes layer and the job).
POOL_LABEL = "gpu-train.io/pool"
CAPACITY_LABEL = "gpu-train.io/capacity"
FABRIC_LABEL = "gpu-train.io/fabric"
GPU_TYPE_LABEL = "gpu-train.io/gpu-type"
GPU_NODE_LABEL = "gpu-train.io/gpu-node"  # "true" on every node of every GPU pool, on no other node
SYSTEM_LABEL = "gpu-train.io/system"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}

# Tags every resource must carry; policies/ checks them.
REQUIRED_TAGS = ("project", "stack", "environment", "managed-by")

# Kubernetes names shared between layers.
CACHE_NAMESPACE = "alluxio"
CACHE_SERVICE_ACCOUNT = "alluxio"
CACHE_PROXY_SERVICE = "alluxio-proxy"
CACHE_PROXY_PORT = 39999
MONITORING_NAMESPACE = "monitoring"
MONITORING_RELEASE = "kube-prometheus-stack"
MLFLOW_NAMESPACE = "mlflow"
MLFLOW_SERVICE_ACCOUNT = "mlflow"
MLFLOW_PORT = 5000
TRAINER_SERVICE_ACCOUNT = "trainer"
KARPENTER_NAMESPACE = "kube-system"
KARPENTER_SERVICE_ACCOUNT = "karpenter"
EBS_CSI_NAMESPACE = "kube-system"
EBS_CSI_SERVICE_ACCOUNT = "ebs-csi-controller-sa"
TEAM_LABEL = "gpu-train.io/team"
METRICS_PORT = 9400  # trainer Prometheus port (TRAINER_METRICS_PORT); local rank r uses METRICS_PORT + r
# The trainer image's numeric user and group (trainer/Dockerfile): training pods run as it, and the
# NVMe DaemonSet (infra/k8s/nvme.py) hands each team's node directory to it.
TRAINER_UID = 10001


def prefix(cfg: StackConfig) -> str:
    """Common name prefix for the stack: gpu-train-<stack>."""
    return f"{PROJECT}-{cfg.stack}"


def resource_name(cfg: StackConfig, *parts: str, max_len: int = 63) -> str:
    """A lowercase, dash-separated physical name, shortened with a stable suffix when too long."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join((prefix(cfg), *parts)).lower()).strip("-")
    if len(name) <= max_len:
        return name
    import hashlib

    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{name[: max_len - 7].rstrip('-')}-{digest}"


def bucket_name(cfg: StackConfig, purpose: str) -> str:
    """Globally unique bucket names need the account/project; callers add that via suffix."""
    return resource_name(cfg, purpose)


def common_tags(cfg: StackConfig) -> dict[str, str]:
    """Tags (AWS) or labels (GCP) for every taggable resource; GCP-safe by construction."""
    tags = {
        "project": PROJECT,
        "stack": cfg.stack,
        "environment": cfg.environment,
        "managed-by": "pulumi",
    }
    tags.update(cfg.tags)
    return tags


def team_namespace(team: str) -> str:
    return f"team-{team}"


def pool_node_labels(pool_name: str, capacity: str, fabric: str, gpu_type: str) -> dict[str, str]:
    """Labels on every node of a GPU pool; the job's node selector uses POOL_LABEL."""
    return {
        GPU_NODE_LABEL: "true",
        POOL_LABEL: pool_name,
        CAPACITY_LABEL: capacity,
        FABRIC_LABEL: fabric,
        GPU_TYPE_LABEL: gpu_type.lower(),
    }
