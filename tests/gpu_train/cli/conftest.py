"""Fixtures for the `gpu-train` tests: a platform contract like an EKS stack publishes (the core's contract model
filled as the AWS layer fills it, from the pools and teams of a dev stack), a job spec file, and the check that a
command's stderr holds only its own error lines. The commands against a cluster are tested on the real control plane
(tests/cluster).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import infra.aws as aws_layer
from gpu_train.jobs import queues
from gpu_train.spec import naming
from gpu_train.spec.catalog.aws import CATALOG as EC2
from gpu_train.spec.contract import Fabric, GpuPool, PlatformContract
from gpu_train.spec.settings import PrepareQuotaSettings, TeamSettings
from infra.aws import cluster as aws_cluster
from infra.aws.node_addons import allocatable

ROOT = Path(__file__).resolve().parents[3]
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/gpu-train-aws-dev-trainer@sha256:" + "c" * 64
REGISTRY = "123456789012.dkr.ecr.us-east-1.amazonaws.com/"


def pools() -> list[GpuPool]:
    out = []
    for name, instance, max_nodes in (("l4-spot", "g6.2xlarge", 4), ("l40s-spot", "g6e.2xlarge", 2)):
        out.append(GpuPool(name=name, instance_type=instance, capacity="spot", gpu_type=EC2[instance].gpu_type,
                           gpus_per_node=EC2[instance].gpus, min_nodes=0, max_nodes=max_nodes, zone="",
                           node_selector={naming.POOL_LABEL: name},
                           tolerations=naming.gpu_tolerations(), fabric=Fabric(kind="none"),
                           provisioner="karpenter", allocatable=allocatable(instance)))
    return out


# research's data preparation quota is above the default, so that a request of several 8-CPU workers fits it.
TEAMS = (TeamSettings(name="research", gpu_quota={"l4-spot": 4}, submitters=("ml-research",),
                      prepare_quota=PrepareQuotaSettings(cpus=32, memory_gi=128)),
         TeamSettings(name="platform", gpu_quota={"l40s-spot": 2}, submitters=("ml-platform",)))


def contract_doc(teams=TEAMS, server: str = "https://ABC.gr7.us-east-1.eks.amazonaws.com") -> dict[str, Any]:
    kubeconfig = json.loads(aws_cluster.kubeconfig("gpu-train-aws-dev", server, "Q0E=", "us-east-1"))
    nvme = "/mnt/k8s-disks/0"
    return PlatformContract(
        stack="aws-dev", cloud="aws", region="us-east-1", project="", kubernetes_version="1.33",
        cluster={"name": "gpu-train-aws-dev", "kubeconfig": kubeconfig}, image=IMAGE, registries=[REGISTRY],
        repositories=[], nvme_host_path=nvme, pools=pools(), teams=queues.team_entries(teams, pools(), nvme),
        kueue=queues.kueue_objects(teams, pools(), aws_layer.SYSTEM_LABELS),
        buckets={"datasets": "s3://gpu-train-aws-dev-datasets", "checkpoints": "s3://gpu-train-aws-dev-checkpoints",
                 "artifacts": "s3://gpu-train-aws-dev-artifacts"},
        endpoints={"objectStore": "https://s3.us-east-1.amazonaws.com",
                   "cache": "http://alluxio-proxy.alluxio.svc.cluster.local:39999/api/v1/s3",
                   "tracking": "http://mlflow.mlflow.svc.cluster.local:5000"},
        logs={"kind": "cloudwatch", "region": "us-east-1",
              "groups": {naming.team_namespace(t.name): f"/gpu-train/gpu-train-aws-dev/{naming.team_namespace(t.name)}"
                         for t in teams}},
        pod_env={"AWS_REGION": "us-east-1"}).document()


@pytest.fixture
def doc() -> dict[str, Any]:
    return contract_doc()


def spec(tmp_path: Path, **over: Any) -> Path:
    """A job spec file (the stack's `job` settings)."""
    settings: dict[str, Any] = {"name": "gpt2-smoke", "team": "research", "pool": "l4-spot", "preset": "gpt2-124m",
                                "nodes": "1:2", "gpusPerNode": 1, "steps": 200, "globalBatchTokens": 65536,
                                "checkpointEvery": 50, "maxRestarts": 5, "overrides": {"train.micro_batch_size": 8}}
    settings.update(over)
    path = tmp_path / f"{settings['name']}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def only_error_lines(err: str) -> bool:
    """Every stderr line is one of the command's own error lines: no traceback."""
    return bool(err.strip()) and all(line.startswith("gpu-train: error: ") for line in err.strip().splitlines())
