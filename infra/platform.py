"""The contract between the cloud layer and the Kubernetes layer.

Usage: `platform = infra.aws.build_platform(cfg, tags)` (or `infra.gcp.build_platform`) returns a
`ClusterPlatform`; everything in `infra/k8s/` reads only this object. Both clouds fill every field,
so the Kubernetes layer never asks which cloud it is on except through these fields.

Fields hold plain values where they are known when the program starts, and `pulumi.Output`s where
they come from the cloud (bucket names, role ARNs, endpoints).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pulumi
import pulumi_kubernetes as k8s

FabricKind = Literal["none", "efa", "tcpx", "tcpxo", "rdma"]


@dataclass(frozen=True, kw_only=True)
class Fabric:
    """How a pod on a pool's nodes uses the high-bandwidth GPU network."""

    kind: FabricKind
    # Extended resources a one-pod-per-node worker requests, e.g. {"vpc.amazonaws.com/efa": 32}.
    resources: Mapping[str, int] = field(default_factory=dict)
    # Pod annotations, e.g. GKE's networking.gke.io/interfaces for multi-network pods.
    annotations: Mapping[str, str] = field(default_factory=dict)
    # NCCL / libfabric environment for the trainer container.
    nccl_env: Mapping[str, str] = field(default_factory=dict)
    # Extra pod volumes (Kubernetes Volume dicts) and the trainer container's mounts of them,
    # e.g. the host's NCCL plugin libraries for TCPX/TCPXO/RDMA.
    volumes: Sequence[Mapping[str, Any]] = ()
    volume_mounts: Sequence[Mapping[str, Any]] = ()
    # Sidecar containers (Kubernetes Container dicts) run as native sidecars (init containers with
    # restartPolicy Always), e.g. the TCPX receive-datapath manager.
    sidecars: Sequence[Mapping[str, Any]] = ()
    # Extra pod networks on GKE multi-networking: one per fabric NIC, each
    # {"name": <Network object name>, "vpc": Output[str], "subnet": Output[str],
    #  "deviceMode": "NetDevice" | "RDMA"}; the k8s layer creates GKENetworkParamSet + Network
    # objects from these, and `annotations` refers to them by name. Empty on AWS.
    networks: Sequence[Mapping[str, Any]] = ()


@dataclass(frozen=True, kw_only=True)
class GpuPool:
    """One GPU node pool as the Kubernetes layer and the job see it."""

    name: str
    instance_type: str
    capacity: str  # spot | on-demand | reservation | capacity-block
    gpu_type: str  # e.g. "H100", "L4"
    gpus_per_node: int
    min_nodes: int
    max_nodes: int
    zone: str  # "" when the pool spans the region's zones
    node_selector: Mapping[str, str]  # selects exactly this pool's nodes
    tolerations: Sequence[Mapping[str, str]]  # tolerate the GPU taint (and any pool taints)
    fabric: Fabric
    # How nodes appear: "karpenter" (AWS NodePool, created on demand), "node-group" (AWS managed
    # node group) or "node-pool" (GKE node pool with the cluster autoscaler).
    provisioner: Literal["karpenter", "node-group", "node-pool"]


@dataclass(frozen=True, kw_only=True)
class WorkloadIdentity:
    """A Kubernetes service account bound to a cloud identity (Pod Identity / IRSA / GKE WI)."""

    namespaces: Sequence[str]  # the service account exists in each of these namespaces
    name: str  # Kubernetes service account name
    annotations: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)  # e.g. iam.gke.io/gcp-service-account


@dataclass(frozen=True, kw_only=True)
class StorageClassSpec:
    """An encrypted (customer-managed key) block StorageClass the k8s layer creates and uses."""

    name: str
    provisioner: str  # ebs.csi.aws.com | pd.csi.storage.gke.io
    parameters: Mapping[str, pulumi.Input[str]]  # includes the KMS key
    volume_binding_mode: str = "WaitForFirstConsumer"


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """Object-store URIs (s3://name or gs://name), no trailing slash."""

    datasets: pulumi.Output[str]
    checkpoints: pulumi.Output[str]
    artifacts: pulumi.Output[str]


@dataclass(frozen=True, kw_only=True)
class Registry:
    """Where the trainer image is pushed, and how to authenticate the push."""

    repository: pulumi.Output[str]  # e.g. 123.dkr.ecr.us-east-1.amazonaws.com/gpu-train-aws-dev-trainer
    server: pulumi.Output[str]  # registry host for docker login
    username: pulumi.Output[str]
    password: pulumi.Output[str]  # secret
    # Where BuildKit keeps its layer cache (a repository whose tags may be overwritten, on the same
    # server and credentials); None: no registry cache.
    cache_repository: pulumi.Input[str] | None = None


@dataclass(frozen=True, kw_only=True)
class ManagedDatabase:
    """A managed PostgreSQL (RDS / Cloud SQL), private and KMS-encrypted, created for MLflow."""

    host: pulumi.Input[str]  # private endpoint address
    port: int = 5432
    database: str = "mlflow"
    username: pulumi.Input[str]
    password: pulumi.Input[str]  # a secret Output
    cidrs: Sequence[str]  # where the endpoint lives, for NetworkPolicy egress (the database subnets)
    sslmode: str = "require"


@dataclass(frozen=True)
class EgressTarget:
    """One extra egress destination pods need, e.g. the node-local workload identity agent."""

    cidr: str
    port: int
    protocol: str = "TCP"


@dataclass(frozen=True, kw_only=True)
class LogStore:
    """Where the team namespaces' container logs are kept after their pods and nodes are gone, when the
    cloud does not keep them itself: the Kubernetes layer installs a log shipper that writes there."""

    kind: Literal["cloudwatch"]  # CloudWatch Logs, written by Fluent Bit (aws-for-fluent-bit)
    region: str
    groups: Mapping[str, pulumi.Input[str]]  # team namespace -> its log group (KMS-encrypted, retention set)
    shipper: WorkloadIdentity  # the shipper's service account, bound to a role that may write only there
    # Where the shipper reaches the store on 443 (the VPC's CloudWatch Logs interface endpoint), for
    # NetworkPolicy egress.
    endpoint_cidrs: Sequence[str]


@dataclass(frozen=True, kw_only=True)
class ClusterPlatform:
    """Everything the Kubernetes layer needs from a cloud."""

    cloud: Literal["aws", "gcp"]
    region: str
    cluster_name: pulumi.Output[str]
    kubernetes_version: str
    provider: k8s.Provider  # built from the cluster's endpoint and CA
    kubeconfig: pulumi.Output[str]  # secret
    gpu_pools: Sequence[GpuPool]
    system_node_selector: Mapping[str, str]  # where controllers (Prometheus, Kueue, cache masters) run
    # Local NVMe of GPU nodes, mounted as one filesystem at this host path. "bootstrap": the node's
    # own bootstrap mounts it (AWS nodeadm RAID0); "daemonset": the disks arrive as raw block
    # devices and the Kubernetes layer runs a privileged DaemonSet that RAID0s and mounts them (GKE).
    nvme_host_path: str
    nvme_setup: Literal["bootstrap", "daemonset"]
    buckets: Buckets
    object_store_endpoint: str  # S3 API endpoint (AWS) or the GCS endpoint, for the trainer and cache
    # CIDRs NetworkPolicies must allow for egress to the object store and cloud APIs over 443.
    object_store_cidrs: Sequence[str]
    api_server_cidrs: Sequence[str]  # control-plane addresses, for NetworkPolicy egress
    vpc_cidr: str
    pod_cidr: str
    storage_class: StorageClassSpec
    # Keys: "cache", "mlflow", and "trainer/<team>" for each team (each team's trainer may read the
    # datasets bucket and read/write only <checkpoints bucket>/<team>/).
    identities: Mapping[str, WorkloadIdentity]
    registry: Registry
    internal_lb_annotations: Mapping[str, str]  # Service annotations for an internal load balancer
    # Resources that must exist before workloads are deployed (node groups, add-ons, access entries).
    ready: Sequence[pulumi.Resource] = ()
    # Where pods get workload-identity credentials (EKS Pod Identity agent, GKE metadata server):
    # NetworkPolicies must allow egress to these.
    workload_identity_egress: Sequence[EgressTarget] = ()
    # The managed PostgreSQL for MLflow, when the settings ask for one (mlflow.database: managed).
    mlflow_database: ManagedDatabase | None = None
    # Where container logs outlive their pods; None: the cloud ships them itself (GKE's Cloud Logging).
    log_store: LogStore | None = None

    def pool(self, name: str) -> GpuPool:
        for pool in self.gpu_pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no GPU pool named {name!r} (pools: {[p.name for p in self.gpu_pools]})")
